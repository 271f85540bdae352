#!/bin/sh
# The NATS server's certificate for a site's store (deploy/nats/nats-server.conf), signed by the
# fleet CA that `stratus certs` made, so that routers check the server against the CA they already
# hold (--tls-ca) and the server checks each router's own certificate against the same CA.
#
#   deploy/nats/server-cert.sh --out DIR --host NAME [--host NAME ...] [--ca-key FILE] [--days N] [--force]
#
# writes DIR/nats-server.pem and DIR/nats-server.key (0600), signed with DIR/ca.pem and its key
# (--ca-key, default DIR/private/ca.key, or DIR/ca.key in an older folder). Every --host is a name
# (or IP) routers dial in --site-state tls://HOST:4222; the certificate carries those alone.
#
# Why not `stratus certs`: it makes identities of Stratus's roles, and the only ones whose
# certificates carry --host names are the router's and the cloud gateway's, which agents, clients
# and routers trust as such (they check a server by its role's name). A NATS server holding one
# could pose as a router or as the cloud. This leaf has no SPIFFE id and no role name: to every
# Stratus process it is no one, and it is good for serving TLS only (serverAuth).
# Needs openssl (1.1.1 or 3.x).
set -eu

usage() {
    echo "usage: $0 --out DIR --host NAME [--host NAME ...] [--ca-key FILE] [--days N] [--force]" >&2
    exit 2
}

out="" ca_key="" days=825 force=0 sans=""
while [ $# -gt 0 ]; do
    case "$1" in
        --out) [ $# -ge 2 ] || usage; out=$2; shift 2 ;;
        --ca-key) [ $# -ge 2 ] || usage; ca_key=$2; shift 2 ;;
        --days) [ $# -ge 2 ] || usage; days=$2; shift 2 ;;
        --host)
            [ $# -ge 2 ] || usage
            case "$2" in
                *[!A-Za-z0-9.:-]* | "" | -*) echo "$0: --host $2 is not a host name or an IP" >&2; exit 2 ;;
                *[!0-9.]* ) case "$2" in *:*) kind=IP ;; *) kind=DNS ;; esac ;;
                *) kind=IP ;;
            esac
            sans="${sans:+$sans,}$kind:$2"
            shift 2 ;;
        --force) force=1; shift ;;
        *) usage ;;
    esac
done
[ -n "$out" ] && [ -n "$sans" ] || usage
case "$days" in *[!0-9]* | "") echo "$0: --days $days is not a number of days" >&2; exit 2 ;; esac

ca="$out/ca.pem"
if [ -z "$ca_key" ]; then
    ca_key="$out/private/ca.key"
    [ -f "$ca_key" ] || [ ! -f "$out/ca.key" ] || ca_key="$out/ca.key"
fi
for file in "$ca" "$ca_key"; do
    [ -f "$file" ] || { echo "$0: no $file: make the fleet CA first (stratus certs --out $out ...)" >&2; exit 1; }
done
cert="$out/nats-server.pem" key="$out/nats-server.key"
if [ "$force" -eq 0 ] && { [ -e "$cert" ] || [ -e "$key" ]; }; then
    echo "$0: $cert or $key exists: --force replaces them" >&2
    exit 1
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
umask 077
cat > "$work/ext" <<EXT
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = $sans
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid:always
EXT
openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$work/key" 2>/dev/null
openssl req -new -key "$work/key" -subj "/OU=nats/CN=nats-server" -out "$work/csr"
openssl x509 -req -in "$work/csr" -CA "$ca" -CAkey "$ca_key" -set_serial "0x$(openssl rand -hex 16)" \
    -days "$days" -sha256 -extfile "$work/ext" -out "$work/cert" 2>/dev/null
chmod 0644 "$work/cert"
mv "$work/key" "$key"
mv "$work/cert" "$cert"
echo "$cert ($sans), $key: signed by $ca"
