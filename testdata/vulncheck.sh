#!/usr/bin/env bash
# Runs govulncheck against an offline vulnerability database: the public
# database is not reachable from CI, so the database is built from the
# golang.org/x/vulndb module (its data/osv folder) at a pinned version.
set -euo pipefail
version=${1:?usage: vulncheck.sh VULNDB_VERSION}
export GOTOOLCHAIN=${GOTOOLCHAIN:-go1.27.3}
dir=$(go mod download -json "golang.org/x/vulndb@${version}" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
[ -d "$dir/data/osv" ] || { echo "vulncheck: no data/osv in $dir" >&2; exit 1; }
db=$(mktemp -d)
trap 'rm -rf "$db"' EXIT
go run "golang.org/x/vulndb/cmd/indexdb@${version}" -vulns "$dir/data/osv" -out "$db"
go run golang.org/x/vuln/cmd/govulncheck@v1.9.0 -db "file://$db" ./...
