# CI only (docker-compose.ci.yaml): the Python base for the kit's Dockerfile,
# built from a debootstrapped Debian bookworm (no registry to pull
# python:3.11-slim from). Debian's python3 is 3.11; pip only to fetch uv
# (the Dockerfile installs it with --target, which PEP 668 allows).
ARG DEBIAN_IMAGE=mcp-ha-kit-ci/debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-pip ca-certificates \
    && rm -rf /var/lib/apt/lists/*
# The host's own CAs (/usr/local/share/ca-certificates, copied here by
# .ci/docker-stage; often none): a CI machine behind a TLS-inspecting proxy
# reaches PyPI only with them. Debian's pip reads the system bundle; uv
# (which the Dockerfile's build stage runs) reads SSL_CERT_FILE.
COPY host-ca-certificates/ /usr/local/share/ca-certificates/
RUN update-ca-certificates >/dev/null
ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
