#!/usr/bin/env bash
# The kubeconfig the agent's unit reads (tasks.metrics.kubeconfig), for the
# koord-runtime-proxy ServiceAccount of deploy/rbac.yaml. Run where kubectl reaches the
# cluster as an admin; copy the file to each node (mode 0600, root) and set
# `tasks.metrics.kube: true`, `kubeconfig: /etc/koord-runtime-proxy/kubeconfig`.
#
#   deploy/kubeconfig.sh [--out FILE] [--server URL] [--ca-file FILE]
#                        [--token-from secret|create|file:PATH] [--duration 720h]
#                        [--namespace NS] [--service-account NAME]
#
# --token-from secret (default): the long-lived token of the Secret in deploy/rbac.yaml;
#   create: a bounded token (`kubectl create token`, --duration; rotate before it ends);
#   file:PATH: a token you already have (no kubectl needed when --server is given too).
# --server/--ca-file default to the current kubectl context's cluster (CA: the Secret's
# ca.crt with --token-from secret). Without a CA the server's certificate is checked
# against the system's trust store; an http:// server needs none.
set -euo pipefail

out=/dev/stdout server="" ca_file="" token_from=secret duration=720h
namespace=koordinator-system account=koord-runtime-proxy
usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --server) server=$2; shift 2 ;;
    --ca-file) ca_file=$2; shift 2 ;;
    --token-from) token_from=$2; shift 2 ;;
    --duration) duration=$2; shift 2 ;;
    --namespace) namespace=$2; shift 2 ;;
    --service-account) account=$2; shift 2 ;;
    -h|--help) usage ;;
    *) echo "kubeconfig.sh: unknown argument: $1" >&2; usage ;;
  esac
done

ca_data=""
case "$token_from" in
  secret)
    secret=$(kubectl -n "$namespace" get secret "$account-token" -o jsonpath='{.data.token}')
    [ -n "$secret" ] || { echo "kubeconfig.sh: secret $namespace/$account-token has no token yet" >&2; exit 1; }
    token=$(printf '%s' "$secret" | base64 -d)
    [ -n "$ca_file" ] || ca_data=$(kubectl -n "$namespace" get secret "$account-token" -o jsonpath='{.data.ca\.crt}')
    ;;
  create)
    token=$(kubectl -n "$namespace" create token "$account" --duration="$duration") ;;
  file:*)
    token=$(tr -d '\r\n' < "${token_from#file:}") ;;
  *) echo "kubeconfig.sh: --token-from secret|create|file:PATH (got '$token_from')" >&2; exit 2 ;;
esac
[ -n "$token" ] || { echo "kubeconfig.sh: empty token" >&2; exit 1; }
if [ -z "$server" ]; then
  server=$(kubectl config view --minify -o jsonpath='{.clusters[0].cluster.server}')
  [ -n "$ca_file" ] || [ -n "$ca_data" ] || \
    ca_data=$(kubectl config view --minify --raw -o jsonpath='{.clusters[0].cluster.certificate-authority-data}')
fi
[ -z "$ca_file" ] || ca_data=$(base64 -w0 < "$ca_file")
case "$server" in http://*|https://*) ;; *) echo "kubeconfig.sh: --server must be a URL (got '$server')" >&2; exit 2 ;; esac

umask 077
{
  echo "apiVersion: v1"
  echo "kind: Config"
  echo "current-context: koord-runtime-proxy"
  echo "clusters:"
  echo "  - name: cluster"
  echo "    cluster:"
  echo "      server: \"$server\""
  [ -z "$ca_data" ] || echo "      certificate-authority-data: $ca_data"
  echo "users:"
  echo "  - name: $account"
  echo "    user:"
  echo "      token: \"$token\""
  echo "contexts:"
  echo "  - name: koord-runtime-proxy"
  echo "    context: {cluster: cluster, user: $account}"
} > "$out"
