# The kit's image: the kit installed, and the demo server (server.py) in /app.
# It is also the base of a server of your own, without forking this file:
#   docker build -t mcp-ha-kit .                 (from the kit's checkout)
#   # your project's Dockerfile:
#   FROM mcp-ha-kit
#   COPY . /app
#   ENV MCP_SERVER_MODULE=my_project.server       (what `python -m` runs; default `server`)
# (examples/jobs/Dockerfile is one.) Which replica it is comes from the
# environment (INSTANCE_ID, REDIS_URL, REDIS_USERNAME, REDIS_PASSWORD,
# SESSION_TTL_SECONDS, MCP_AUTH*, HOST, PORT; see docs/operations.md).
ARG BASE_IMAGE=python:3.11-slim

# uv and its download cache stay in this stage; only the venv moves on.
FROM ${BASE_IMAGE} AS build
# The venv outside /app, so a server's `COPY . /app` cannot replace it.
ENV UV_PROJECT_ENVIRONMENT=/opt/venv \
    UV_PYTHON_DOWNLOADS=never \
    UV_LINK_MODE=copy \
    UV_COMPILE_BYTECODE=1 \
    UV_NO_CACHE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# --target, not a plain install: Debian's python3 refuses system-wide pip
# installs (PEP 668), the official image doesn't, and this works in both.
RUN python3 -m pip install --no-cache-dir --target /opt/uv uv==0.13.9
WORKDIR /src
# Seeded with pip (uv sync keeps it), so a server's own Dockerfile can
# `pip install` what it needs beyond the kit into the same venv.
RUN /opt/uv/bin/uv venv --seed --python python3 /opt/venv
# Dependencies before the kit's sources, so editing the kit doesn't re-resolve them.
# With the tasks extra: the demo's analyze_data (and a server's task=True tools) run as durable tasks.
COPY pyproject.toml uv.lock ./
RUN /opt/uv/bin/uv sync --frozen --no-default-groups --extra tasks --no-install-project
# The kit itself, as a package (not editable: /src stays in this stage).
# The wheel carries haproxy/ and the deployment files (`mcp-ha deploy`; pyproject's force-include).
COPY README.md docker-compose.yaml docker-compose.sentinel.yaml docker-compose.cluster.yaml ./
COPY haproxy/ ./haproxy/
COPY deploy/ ./deploy/
COPY mcp_ha/ ./mcp_ha/
RUN /opt/uv/bin/uv sync --frozen --no-default-groups --extra tasks --no-editable

FROM ${BASE_IMAGE}
RUN groupadd --system --gid 10001 app \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin app
# Same base image and same path as in the build stage, so the venv's
# interpreter links and script shebangs stay valid.
COPY --from=build /opt/venv /opt/venv
WORKDIR /app
# Owned by root and read-only to the server: a compromised replica can't
# rewrite its own code (nor the venv's).
COPY server.py ./
ENV HOST=0.0.0.0 PORT=8000 PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 MCP_SERVER_MODULE=server
USER 10001:10001
EXPOSE 8000
# /health answers 200 only while the replica reaches its store, so compose
# waits for a replica that can actually serve; urlopen raises (exit 1) on 503.
# Failures in the start period don't count (a loaded machine may take 20 s to
# import a server), and the first success ends it: a long one costs nothing.
HEALTHCHECK --interval=5s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; r = urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('PORT', '8000'), timeout=2); sys.exit(r.status != 200)"]
# The shell only reads the module's name, then `exec` makes Python PID 1: uvicorn
# gets SIGTERM itself and drains within its 10 s, inside compose's 15 s stop grace period.
STOPSIGNAL SIGTERM
CMD ["sh", "-c", "exec python -m \"${MCP_SERVER_MODULE:?set MCP_SERVER_MODULE, the server module to run}\""]
