# A Redis server of the Sentinel topology (StatefulSet redis, from the
# ConfigMap redis-scripts), run in its volume (workingDir /data). It starts as
# the replica of whatever is the primary now (primary.sh), so a server coming
# back after a failover is never a second primary, not even for the seconds
# Sentinel would take to reconfigure it. The users are docker-compose.yaml's
# and stack.py's, written at each start with hashed passwords, except
# masterauth, which Redis must send; the file is the redis user's only.
# Memory is bounded as in ../kubernetes/redis.yaml (half the container's
# limit; full: writes refused, nothing evicted).
set -eu
. "$(dirname "$0")/primary.sh"
plain_password REDIS_REPLICATION_PASSWORD "$REDIS_REPLICATION_PASSWORD"
me=$(own_entry "$REDIS_SERVERS")
primary=$(current_primary "$me")
umask 077
hash() { printf %s "$1" | sha256sum | cut -d' ' -f1; }
{
  cat <<CONF
port ${me##*:}
user default on #$(hash "$REDIS_ADMIN_PASSWORD") ~* &* +@all
user mcp on #$(hash "$REDIS_PASSWORD") resetkeys ~mcp:* resetchannels &mcp:* -@all +ping +info +fcall +wait +time +expire +zadd +zremrangebyscore +zcard +hget +hset +hincrby +hgetall +hkeys +hmget +hexists +hdel +hstrlen +exists +zscore +zrem +get +set +lindex +rpush +lpop +lrange +publish +subscribe +unsubscribe +zrange +pttl +llen (~mcp:tasks:* &mcp:tasks:* &mcp:tasks:cancel:* +multi +exec +discard +evalsha +script|load +del +setex +mget +pexpire +ttl +sadd +srem +smembers +zcount +zrangebyscore +xadd +xack +xdel +xlen +xrange +xread +xreadgroup +xautoclaim +xclaim +xgroup|create +psubscribe +punsubscribe)
user sentinel on #$(hash "$REDIS_SENTINEL_AUTH_PASSWORD") resetkeys resetchannels &__sentinel__:hello -@all +multi +exec +slaveof +ping +info +role +config|rewrite +client|setname +client|kill +script|kill +publish +subscribe
user replication on #$(hash "$REDIS_REPLICATION_PASSWORD") resetkeys resetchannels -@all +psync +replconf +ping
masteruser replication
masterauth "$REDIS_REPLICATION_PASSWORD"
appendonly yes
appendfsync everysec
save ""
repl-diskless-sync-delay 0
maxmemory 256mb
maxmemory-policy noeviction
replica-announce-ip ${me%:*}
CONF
  # By name: the sentinels and the replicas resolve it, whatever address the pod has now.
  if [ "$primary" != "$me" ]; then
    echo "replicaof ${primary%:*} ${primary##*:}"
  fi
} > redis.conf
# The kit's functions (deploy/redis, mounted at /functions beside /scripts), loaded by the admin into
# a primary once it answers (its replicas get them from it), for at most a minute. In the
# background: Redis is still PID 1.
functions="$(dirname "$0")/../functions/functions.lua"
(for _ in $(seq 300); do
  if redis-cli -p "${me##*:}" ping 2>/dev/null | grep -q PONG; then
    redis-cli -p "${me##*:}" info replication | grep -q role:master || exit 0
    exec redis-cli -p "${me##*:}" -x FUNCTION LOAD REPLACE < "$functions" > /dev/null
  fi
  sleep 0.2
done) &
exec redis-server redis.conf "$@"
