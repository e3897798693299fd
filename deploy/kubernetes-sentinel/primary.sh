# Sourced by redis.sh and sentinel.sh (with, at the end, the check of the
# passwords they write in clear): where the Redis primary is now, asked by a
# server or a sentinel as it starts. Neither may trust what it knew before:
# a failover may have happened while it was away. In order:
#   1. what a sentinel answers (once any runs, the sentinels know);
#   2. else a Redis server that says it is a primary (every sentinel is down
#      or not yet started);
#   3. else the first of REDIS_SERVERS: a new install.
# REDIS_SERVERS and REDIS_SENTINELS are host:port lists (the ConfigMap
# redis-topology); the answer is host:port, one of REDIS_SERVERS.

words() { printf %s "$1" | tr , ' '; }

# This pod's entry in a host:port list: the one named after it.
own_entry() {
  for entry in $(words "$1"); do
    case $entry in "$POD_NAME".*) echo "$entry"; return 0 ;; esac
  done
  echo "$POD_NAME is not in $1" >&2
  return 1
}

# An answer is trusted only if it names a server of ours: anything else (an
# error reply, nothing) means "ask the next one".
is_server() {
  case ",$REDIS_SERVERS," in *",$1,"*) [ -n "$1" ] ;; *) return 1 ;; esac
}

# $1: the caller's own server entry (a server does not ask itself: it is not up).
current_primary() {
  for sentinel in $(words "$REDIS_SENTINELS"); do
    answer=$(REDISCLI_AUTH=$REDIS_ADMIN_PASSWORD timeout 2 redis-cli --no-auth-warning \
      -h "${sentinel%:*}" -p "${sentinel##*:}" sentinel get-master-addr-by-name "$REDIS_MASTER_NAME" \
      2>/dev/null | paste -sd:) || true
    if is_server "$answer"; then
      echo "the primary is $answer, says the sentinel $sentinel" >&2
      echo "$answer"
      return 0
    fi
  done
  for server in $(words "$REDIS_SERVERS"); do
    [ "$server" != "${1:-}" ] || continue
    role=$(REDISCLI_AUTH=$REDIS_SENTINEL_AUTH_PASSWORD timeout 2 redis-cli --no-auth-warning --user sentinel \
      -h "${server%:*}" -p "${server##*:}" role 2>/dev/null | head -n1) || true
    if [ "$role" = master ]; then
      echo "no sentinel answered; $server says it is the primary" >&2
      echo "$server"
      return 0
    fi
  done
  server=$(words "$REDIS_SERVERS" | cut -d' ' -f1)
  echo "no sentinel answered and no other server is a primary (a new install): the primary is $server, the first of REDIS_SERVERS" >&2
  echo "$server"
}

# A password written in clear into redis.conf or sentinel.conf (and written
# back unquoted by Sentinel's own rewrite) must be one the file can hold;
# otherwise Redis would refuse the file and print the line, password and all,
# in its log. $1: the variable's name, $2: its value.
plain_password() {
  case $2 in
    '' | *[!!-~]* | *[\"\'\\]*)
      echo "$1: use printable ASCII without spaces, quotes or backslashes" >&2
      return 1 ;;
  esac
}
