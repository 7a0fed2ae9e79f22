#!/opt/yutu/bin/python3
"""Container health probe: exit 0 when ``$YUTU_HEALTH_URL`` (or argv[1]) answers 200, else 1.

Installed as ``yutu-health`` in the image; every service's admin app serves ``/health``.
"""

import os
import sys
import urllib.request

url = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("YUTU_HEALTH_URL", "http://127.0.0.1:9000/health")
try:
    with urllib.request.urlopen(url, timeout=2.5) as reply:
        sys.exit(0 if reply.status == 200 else 1)
except OSError as exc:
    print(f"{url}: {exc}", file=sys.stderr)
    sys.exit(1)
