# A sentinel (StatefulSet sentinel, from the ConfigMap redis-scripts), run in
# an emptyDir (workingDir /data): Sentinel rewrites its file as it learns.
# It starts from nothing, monitoring the primary of now (primary.sh), and
# learns the other sentinels and the replicas from them and the servers.
# Everything is announced by name (pods come back with new addresses). A
# majority of the sentinels is the quorum; the primary counts as down after
# 1 s, as in compose and stack.py. The sentinels log in to each other as the
# admin (sentinel-pass), to the servers as `sentinel`; the replicas' user may
# only ask where the primary is.
set -eu
. "$(dirname "$0")/primary.sh"
plain_password REDIS_ADMIN_PASSWORD "$REDIS_ADMIN_PASSWORD"
plain_password REDIS_SENTINEL_AUTH_PASSWORD "$REDIS_SENTINEL_AUTH_PASSWORD"
me=$(own_entry "$REDIS_SENTINELS")
primary=$(current_primary)
quorum=$(( $(words "$REDIS_SENTINELS" | wc -w) / 2 + 1 ))
umask 077
hash() { printf %s "$1" | sha256sum | cut -d' ' -f1; }
cat > sentinel.conf <<CONF
port ${me##*:}
user default on #$(hash "$REDIS_ADMIN_PASSWORD") ~* &* +@all
user mcp on #$(hash "$REDIS_PASSWORD") -@all +ping +sentinel|masters +sentinel|get-master-addr-by-name
sentinel sentinel-pass "$REDIS_ADMIN_PASSWORD"
sentinel resolve-hostnames yes
sentinel announce-hostnames yes
sentinel announce-ip ${me%:*}
sentinel announce-port ${me##*:}
sentinel monitor $REDIS_MASTER_NAME ${primary%:*} ${primary##*:} $quorum
sentinel auth-user $REDIS_MASTER_NAME sentinel
sentinel auth-pass $REDIS_MASTER_NAME "$REDIS_SENTINEL_AUTH_PASSWORD"
sentinel down-after-milliseconds $REDIS_MASTER_NAME 1000
sentinel failover-timeout $REDIS_MASTER_NAME 10000
sentinel parallel-syncs $REDIS_MASTER_NAME 1
CONF
exec redis-server sentinel.conf --sentinel "$@"
