# CI only: stands in for the official redis:7.0 image with Debian bookworm's
# redis-server 7.0. docker-compose.yaml's redis command is run unchanged: a
# `sh -c` script (dash; sha256sum and cut from coreutils, in minbase) that
# ends in `exec docker-entrypoint.sh redis-server ...`, so this image has a
# docker-entrypoint.sh like the official one (see redis-entrypoint.sh).
ARG DEBIAN_IMAGE=mcp-ha-kit-ci/debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server redis-tools \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /data && chown redis:redis /data
COPY redis-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
WORKDIR /data
VOLUME /data
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["redis-server"]
