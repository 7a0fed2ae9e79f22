# Stand-in for the official redis:7 image where no registry is reachable (scripts/docker-base.sh
# builds it only when `docker pull redis:7` fails): Debian bookworm's redis-server (7.0) on the base
# image, run as the unprivileged redis user with its data in /data like the official image.
# docker-compose.yml gives the same command line to either image.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb \
 && mkdir -p /data && chown redis:redis /data
WORKDIR /data
USER redis
EXPOSE 6379
CMD ["redis-server", "--protected-mode", "no", "--dir", "/data"]
