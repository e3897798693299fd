# CI only: stands in for the official haproxy:2.6 image with Debian
# bookworm's haproxy 2.6 (built with Lua, which refuse_body.lua needs).
# Runs as the haproxy user like the official image, in the foreground
# (-db) in master-worker mode (-W), on the config compose mounts.
ARG DEBIAN_IMAGE=mcp-ha-kit-ci/debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends haproxy \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /usr/local/etc/haproxy
USER haproxy
STOPSIGNAL SIGUSR1
CMD ["haproxy", "-W", "-db", "-f", "/usr/local/etc/haproxy/haproxy.cfg"]
