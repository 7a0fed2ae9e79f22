# One runtime image for every Yutu service: the entry point is `yutu`, the command picks the role
# (`yutu gateway`, `yutu decode`, `yutu store-node`, ...). Build it with scripts/docker-build.sh,
# which also makes the base image when no registry is reachable (docs/deployment.md).
#
# Works with the classic builder and with BuildKit alike (no BuildKit-only syntax).
#   torch: the CPU build by default. Online it comes from PyTorch's own index (TORCH_INDEX);
#          offline from a directory of wheels, the `wheels` stage: scripts/docker-build.sh packs the
#          directory into an image and passes --build-arg WHEELS=<it>; with BuildKit,
#          `--build-context wheels=DIR` does the same. CUDA: --build-arg TORCH_INDEX=.../whl/cu128.
#   layers: base packages, torch, the other dependencies (from pyproject.toml alone), the demo
#          model, then the source: editing code rebuilds only the last, small layers (and the
#          portable kernels, compiled in a stage of their own from libs/: ~1.5 min on 2 cores).

ARG BASE_IMAGE=debian:bookworm-slim
ARG WHEELS=no-wheels

# No local wheels: an empty stage. Replaced by --build-arg WHEELS=<image> or --build-context wheels=DIR.
FROM scratch AS no-wheels
FROM ${WHEELS} AS wheels

# ---- deps: a virtualenv in /opt/yutu with torch and the other dependencies ------------------
FROM ${BASE_IMAGE} AS deps
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      python3 python3-venv ca-certificates >/dev/null \
 && rm -rf /var/lib/apt/lists/*
# Extra CA certificates for a TLS-intercepting proxy between the build and PyPI (Dockerfiles/ca/*.crt,
# normally none; scripts/docker-build.sh copies this machine's local CAs there). Build stage only.
COPY Dockerfiles/ca/ /usr/local/share/ca-certificates/
RUN update-ca-certificates >/dev/null 2>&1 && python3 -m venv /opt/yutu
ENV PATH=/opt/yutu/bin:$PATH \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore
COPY --from=wheels / /wheels/
# torch alone first (its own layer: the largest and the least often changed).
RUN set -e; \
    if ls /wheels/torch-${TORCH_VERSION}[+-]*.whl >/dev/null 2>&1; then \
      pip install -q --no-deps /wheels/torch-${TORCH_VERSION}[+-]*.whl; \
    else \
      pip install -q --no-deps --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"; \
    fi; \
    rm -rf /wheels
# The other dependencies, from pyproject.toml only (torch held at the build installed above).
COPY pyproject.toml /src/pyproject.toml
RUN set -e; cd /src; \
    python3 -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/requirements.txt; \
    python3 -c "from importlib.metadata import version; print('torch==' + version('torch'))" > /tmp/constraints.txt; \
    pip install -q -r /tmp/requirements.txt -c /tmp/constraints.txt; \
    rm /tmp/requirements.txt /tmp/constraints.txt

# ---- kernels: the native CPU kernels (yutu.engine.native), compiled here for any x86-64-v3 CPU ---
# (AVX2 and FMA: Haswell, Zen 1 and later), since the runtime has no compiler; engines load them
# where they cannot build their own. Elsewhere (arm64) none: engines run on torch's operations.
FROM deps AS kernels
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++ python3-dev >/dev/null \
 && rm -rf /var/lib/apt/lists/*
COPY libs /src/libs
ENV YUTU_CACHE_DIR=/var/cache/yutu
RUN set -e; mkdir -p /var/cache/yutu/kernels; \
    if [ "$(uname -m)" = x86_64 ]; then PYTHONPATH=/src/libs python3 -m yutu.engine.native --portable; \
    else echo "no portable kernels for $(uname -m): engines will run on torch's operations"; fi; \
    find /var/cache/yutu/kernels -type f ! -name yutu_native.so -delete

# ---- build: the source and the demo model on top of the dependencies --------------------------
FROM deps AS build
# What the runtime never uses: torch's C++ headers, test suites and test binaries.
RUN set -e; site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
    cd "$site/torch"; \
    rm -rf include test share/cmake lib/libtorchbind_test.so lib/libjitbackend_test.so \
           lib/libbackend_with_compiler.so lib/libaoti_custom_ops.so; \
    find bin -type f ! -name torch_shm_manager -delete; \
    cd "$site"; find numpy sympy networkx -depth -type d -name tests -exec rm -rf {} +
# The source last, apart from the dependencies (/opt/yutu-app, on the path through a .pth file):
# a code change rebuilds from here on, and the runtime's large dependency layer stays the same.
RUN site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
 && echo /opt/yutu-app > "$site/yutu-app.pth"
COPY Dockerfiles/yutu-cli.py /opt/yutu/bin/yutu
COPY Dockerfiles/healthcheck.py /opt/yutu/bin/yutu-health
COPY Dockerfiles/entrypoint.sh /opt/yutu/bin/yutu-entrypoint
COPY README.md /src/README.md
COPY libs /src/libs
COPY services /src/services
RUN pip install -q --no-deps --no-build-isolation --target /opt/yutu-app /src \
 && rm -rf /opt/yutu-app/bin /src \
 && chmod 0755 /opt/yutu/bin/yutu /opt/yutu/bin/yutu-health /opt/yutu/bin/yutu-entrypoint
# The built-in demo model, made here once (deterministic, no download) so no container makes it;
# the portable kernels beside it.
ENV YUTU_CACHE_DIR=/var/cache/yutu
COPY --from=kernels /var/cache/yutu/kernels /var/cache/yutu/kernels
RUN python3 -c "from yutu.engine.default_model import ensure_default_model as e; print(e())"

# ---- runtime: Debian's python3 and the virtualenv, nothing else --------------------------------
FROM ${BASE_IMAGE} AS runtime
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3 >/dev/null \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb \
 && useradd --uid 10001 --user-group --home-dir /home/yutu --create-home yutu \
 && mkdir -p /var/cache/yutu && chown yutu:yutu /var/cache/yutu
COPY --from=build /opt/yutu /opt/yutu
COPY --from=build /opt/yutu-app /opt/yutu-app
COPY --from=build --chown=yutu:yutu /var/cache/yutu /var/cache/yutu
ENV PATH=/opt/yutu/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    YUTU_CACHE_DIR=/var/cache/yutu \
    YUTU_HOST=0.0.0.0 \
    OMP_NUM_THREADS=1
USER yutu
WORKDIR /home/yutu
# Each service's admin /health; docker-compose.yml points it at the service's own port.
ENV YUTU_HEALTH_URL=http://127.0.0.1:9000/health
HEALTHCHECK --interval=5s --timeout=3s --start-period=60s --retries=5 CMD ["yutu-health"]
ENTRYPOINT ["yutu-entrypoint"]
CMD ["--help"]
