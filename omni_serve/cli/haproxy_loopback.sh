#!/bin/sh
# HAProxy as Ray Serve 2.60 starts it (`haproxy -db -f CONFIG [-sf PIDS] [-x SOCKET]`, anew for every
# start and reload), with what Serve's config template opens to everyone kept to this machine:
#   - its stats page (`listen stats`, `bind *:$RAY_SERVE_HAPROXY_STATS_PORT`) and its Prometheus endpoint
#     (`bind :$RAY_SERVE_HAPROXY_METRICS_PORT`), which listen on every interface: bound to 127.0.0.1;
#   - its admin socket (`stats socket ... mode 666 level admin`: any local user could drain servers):
#     mode 600, its owner only (Serve's proxy, the same user, talks to it).
# And one line added to `frontend http_frontend`: X-Forwarded-For set to the client's address (`%[src]`).
# Serve's template forwards none, so an ingress replica saw every client as HAProxy, and the per-client quota
# (realtime.max_sessions_per_client) capped them all together; the replica's uvicorn takes the header from a
# loopback peer (FORWARDED_ALLOW_IPS' default), which HAProxy is to a replica on its node (other nodes:
# docs/realtime.md, who a client is). Set, not appended (`option forwardfor`): uvicorn takes the right-most
# address it does not trust, so behind an appending HAProxy a client on 127.0.0.1 would be whoever it named.
# Ray has no setting for these (ray/serve/_private/haproxy_templates.py); it has one for the binary,
# RAY_SERVE_HAPROXY_BINARY_PATH, which omni_serve.cli.run points here, with OMNI_SERVE_HAPROXY_BINARY
# naming the real one. Each of the four rewrites must have happened: a config without one of those lines
# (a changed template) fails the start loudly, naming the line, rather than leaving its port or socket open
# or its clients unknown.
set -eu
real="${OMNI_SERVE_HAPROXY_BINARY:?OMNI_SERVE_HAPROXY_BINARY must name the real haproxy binary}"
stats="${RAY_SERVE_HAPROXY_STATS_PORT:-8404}"
metrics="${RAY_SERVE_HAPROXY_METRICS_PORT:-9101}"
# rewritten PATTERN WHAT CONFIG: the rewritten config has a line matching PATTERN, else stop before HAProxy runs.
rewritten() {
  if ! grep -q "$1" "$3.loopback"; then
    echo "omni_serve haproxy_loopback.sh: no $2 in $3 to rewrite (Serve's template changed?);" \
      "not starting HAProxy" >&2
    exit 1
  fi
}
previous=""
for arg do
  shift
  if [ "$previous" = "-f" ]; then
    sed -e "s/^\([[:space:]]*bind \)\*:${stats}\$/\1127.0.0.1:${stats}/" \
        -e "s/^\([[:space:]]*bind \):${metrics}\$/\1127.0.0.1:${metrics}/" \
        -e "s/^\([[:space:]]*stats socket .*\) mode 666 /\1 mode 600 /" \
        -e "/^frontend http_frontend\$/a\\
    http-request set-header X-Forwarded-For %[src]" "$arg" > "$arg.loopback"
    rewritten "^[[:space:]]*bind 127.0.0.1:${stats}\$" "the stats line 'bind *:${stats}'" "$arg"
    rewritten "^[[:space:]]*bind 127.0.0.1:${metrics}\$" "the metrics line 'bind :${metrics}'" "$arg"
    rewritten "^[[:space:]]*stats socket .* mode 600 " "the admin socket line 'stats socket ... mode 666 ...'" "$arg"
    rewritten "^[[:space:]]*http-request set-header X-Forwarded-For %\[src\]\$" "the section 'frontend http_frontend'" "$arg"
    arg="$arg.loopback"
  fi
  set -- "$@" "$arg"
  previous="$arg"
done
exec "$real" "$@"
