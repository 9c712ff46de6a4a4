#!/bin/sh
# Runs a command in a mount namespace of its own in which host names resolve from /etc/hosts alone
# (nsswitch's "hosts: files"), where it can (root, unshare, findmnt); elsewhere, as it is.
#
# c10d's TCPStore client looks up the host name of its own address at a process's first connect,
# IPv4-mapped (::ffff:127.0.0.1, which /etc/hosts never names; src/phalanx/launch/name_lookup.py
# times it). The name server of the machines that run this project's CI drops queries when several
# come at once, and glibc then waits 5 s a lookup: a store connect over loopback takes 5 or 10 s,
# past the few seconds a unit test of the lobby allows its nodes to meet. Without the name server the lookup ends at once,
# as a cluster's name server answers. The tests need none: test-bed hosts resolve from hosts files.
#
# Network namespaces made inside (ip netns add, the test bed) stay visible to this machine: the
# /run/netns mount stays shared with it, as `ip netns` makes it; only the mount that holds
# /etc/nsswitch.conf turns private.
if [ "$(id -u)" = 0 ] && [ -z "${HOSTS_FILES_ONLY:-}" ] && [ -f /etc/nsswitch.conf ] \
	&& command -v unshare >/dev/null && command -v findmnt >/dev/null && unshare --mount true 2>/dev/null; then
	mkdir -p /run/netns
	mountpoint -q /run/netns || mount --bind /run/netns /run/netns
	mount --make-shared /run/netns
	# The copy stays while the command runs (a test may bind another file over the bound one, which
	# fails once the copy is unlinked), and goes after.
	conf=$(mktemp /run/phalanx-tests-nsswitch.XXXXXX)
	trap 'rm -f "$conf"' EXIT
	trap 'exit 130' INT
	trap 'exit 143' TERM
	sed 's/^hosts:.*/hosts: files/' /etc/nsswitch.conf >"$conf"
	unshare --mount --propagation unchanged sh -c '
		mount --make-private "$(findmnt -no TARGET -T /etc/nsswitch.conf)" && mount --bind "$0" /etc/nsswitch.conf \
			|| echo "hosts_files_only.sh: names resolve as on this machine" >&2
		HOSTS_FILES_ONLY=1 exec "$@"' "$conf" "$@"
	exit
fi
exec "$@"
