# Makes the nodes of REDIS_SERVERS (host:port,...) one Redis Cluster, a replica
# for each primary, unless they are one already; then waits, for a minute at
# most, until every node serves every slot. The Job in create.yaml runs it, and
# the one-shot service redis-cluster of docker-compose.cluster.yaml. It logs in
# as the admin (REDISCLI_AUTH).
set -eu
nodes=$(printf %s "$REDIS_SERVERS" | tr , ' ')
at() { node=$1; shift; redis-cli -h "${node%:*}" -p "${node##*:}" "$@"; }
count=$(echo "$nodes" | wc -w)
# Every node answering first (a new install starts them together), for a minute at most.
for _ in $(seq 300); do
  up=0
  for node in $nodes; do
    if at "$node" ping 2>/dev/null | grep -q PONG; then up=$((up + 1)); fi
  done
  [ "$up" = "$count" ] && break
  sleep 0.2
done
first=${nodes%% *}
known=$(at "$first" cluster info | tr -d '\r' | sed -n 's/^cluster_known_nodes://p')
if [ "${known:-1}" -lt "$count" ]; then
  # By address: CLUSTER MEET takes no names in Redis 7.0.
  addresses=""
  for node in $nodes; do
    ip=$(getent hosts "${node%:*}" | cut -d' ' -f1)
    addresses="$addresses ${ip:?${node%:*} does not resolve}:${node##*:}"
  done
  # shellcheck disable=SC2086 # one word per node
  redis-cli --cluster create $addresses --cluster-replicas 1 --cluster-yes
fi
for _ in $(seq 300); do
  ok=1
  for node in $nodes; do
    at "$node" cluster info | grep -q cluster_state:ok || ok=0
  done
  if [ "$ok" = 1 ]; then
    echo "the Redis Cluster serves every slot"
    exit 0
  fi
  sleep 0.2
done
echo "the Redis Cluster did not reach cluster_state:ok within a minute" >&2
exit 1
