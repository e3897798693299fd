# One image for every replica; which replica it is comes from the environment
# (INSTANCE_ID, REDIS_URL, REDIS_USERNAME, REDIS_PASSWORD, SESSION_TTL_SECONDS,
# MCP_AUTH*, HOST, PORT; see docs/operations.md).
ARG BASE_IMAGE=python:3.11-slim

# uv and its download cache stay in this stage; only the venv moves on.
FROM ${BASE_IMAGE} AS build
ENV UV_PYTHON_DOWNLOADS=never \
    UV_LINK_MODE=copy \
    UV_COMPILE_BYTECODE=1 \
    UV_NO_CACHE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# --target, not a plain install: Debian's python3 refuses system-wide pip
# installs (PEP 668), the official image doesn't, and this works in both.
RUN python3 -m pip install --no-cache-dir --target /opt/uv uv==0.13.9
WORKDIR /app
# Dependencies before sources, so editing server.py doesn't re-resolve them.
COPY pyproject.toml uv.lock ./
RUN /opt/uv/bin/uv sync --frozen --no-default-groups --no-install-project

FROM ${BASE_IMAGE}
RUN groupadd --system --gid 10001 app \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin app
WORKDIR /app
# Same base image and same path as in the build stage, so the venv's
# interpreter links and script shebangs stay valid.
COPY --from=build /app/.venv /app/.venv
# Owned by root and read-only to the server: a compromised replica can't
# rewrite its own code.
COPY server.py session_store.py ./
COPY mcp_ha/ ./mcp_ha/
COPY stores/ ./stores/
ENV HOST=0.0.0.0 PORT=8000 PATH=/app/.venv/bin:$PATH PYTHONUNBUFFERED=1
USER 10001:10001
EXPOSE 8000
# /health answers 200 only while the replica reaches its store, so compose
# waits for a replica that can actually serve; urlopen raises (exit 1) on 503.
HEALTHCHECK --interval=5s --timeout=3s --start-period=5s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; r = urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('PORT', '8000'), timeout=2); sys.exit(r.status != 200)"]
# Python is PID 1 (exec form, no shell in between): uvicorn gets SIGTERM
# itself and drains within its 10 s, inside compose's 15 s stop grace period.
STOPSIGNAL SIGTERM
CMD ["python", "server.py"]
