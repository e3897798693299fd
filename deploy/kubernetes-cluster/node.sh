# A node of the Redis Cluster topology, on Kubernetes (StatefulSet redis, from
# the ConfigMap redis-scripts) and in docker-compose.cluster.yaml alike, run in
# its data directory. Its slots and role live in nodes.conf there, beside its
# AOF, so a node started again rejoins as it was. The users are the single
# Redis's, with the kit's user's cluster rights (REDIS_KIT_CLUSTER_ACL in
# mcp_ha/ops/stack.py), written at each start with hashed passwords, except
# masterauth, which Redis must send; the file is the redis user's only. It
# announces its name (redis-N.redis), so the slot map names hosts that still
# resolve after the pod comes back with another address. Memory is bounded as
# for one Redis (full: writes refused, nothing evicted).
set -eu
case $REDIS_REPLICATION_PASSWORD in *[!!-~]* | *[\"\'\\]*)
  echo "REDIS_REPLICATION_PASSWORD: use printable ASCII without spaces, quotes or backslashes" >&2
  exit 1 ;;
esac
# This node's entry in REDIS_SERVERS (host:port,...): the one named after it.
me=""
for entry in $(printf %s "$REDIS_SERVERS" | tr , ' '); do
  case $entry in "$POD_NAME".* | "$POD_NAME":*) me=$entry ;; esac
done
if [ -z "$me" ]; then
  echo "$POD_NAME is not in REDIS_SERVERS ($REDIS_SERVERS)" >&2
  exit 1
fi
port=${me##*:}
umask 077
hash() { printf %s "$1" | sha256sum | cut -d' ' -f1; }
cat > redis.conf <<CONF
port $port
user default on #$(hash "$REDIS_ADMIN_PASSWORD") ~* &* +@all
user mcp on #$(hash "$REDIS_PASSWORD") resetkeys ~mcp:* resetchannels &mcp:* -@all +ping +info +fcall +wait +time +expire +zadd +zremrangebyscore +zcard +hget +hset +hincrby +hgetall +hkeys +hmget +hexists +hdel +hstrlen +exists +zscore +zrem +get +set +lindex +rpush +lpop +lrange +publish +subscribe +unsubscribe +zrange +pttl +llen +cluster|slots +command +asking +spublish +ssubscribe +sunsubscribe (~{mcp:tasks}:* &{mcp:tasks}:* &{mcp:tasks}:cancel:* +time +expire +zadd +zremrangebyscore +zcard +hget +hset +hincrby +hgetall +hkeys +hmget +hexists +hdel +hstrlen +exists +zscore +zrem +get +set +lindex +rpush +lpop +lrange +publish +subscribe +unsubscribe +zrange +pttl +llen +multi +exec +discard +evalsha +script|load +del +setex +mget +pexpire +ttl +sadd +srem +smembers +zcount +zrangebyscore +xadd +xack +xdel +xlen +xrange +xread +xreadgroup +xautoclaim +xclaim +xgroup|create +psubscribe +punsubscribe +eval +pexpireat)
user replication on #$(hash "$REDIS_REPLICATION_PASSWORD") resetkeys resetchannels -@all +psync +replconf +ping
masteruser replication
masterauth "$REDIS_REPLICATION_PASSWORD"
cluster-enabled yes
cluster-config-file nodes.conf
cluster-node-timeout 1000
cluster-require-full-coverage no
cluster-announce-hostname ${me%:*}
cluster-preferred-endpoint-type hostname
appendonly yes
appendfsync everysec
save ""
repl-diskless-sync-delay 0
maxmemory 256mb
maxmemory-policy noeviction
CONF
# The kit's functions for a cluster (deploy/redis, mounted at /functions beside /scripts), loaded by
# the admin into this node while it is a primary, once it answers (a replica gets them from its
# primary; a node added later with redis-cli --cluster add-node gets them copied), for at most a
# minute. In the background: Redis is still PID 1.
functions="$(dirname "$0")/../functions/functions-cluster.lua"
(for _ in $(seq 300); do
  if redis-cli -p "$port" ping 2>/dev/null | grep -q PONG; then
    redis-cli -p "$port" info replication | grep -q role:master || exit 0
    exec redis-cli -p "$port" -x FUNCTION LOAD REPLACE < "$functions" > /dev/null
  fi
  sleep 0.2
done) &
# The image's entrypoint, where there is one, gives the data directory to the redis user and drops root.
if command -v docker-entrypoint.sh > /dev/null; then
  exec docker-entrypoint.sh redis-server redis.conf "$@"
fi
exec redis-server redis.conf "$@"
