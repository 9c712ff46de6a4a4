#!/bin/sh
# Runs a command with an empty resolv.conf (/dev/null: no name server), in a mount namespace of its
# own, where it can (root and unshare); elsewhere, as it is.
#
# c10d's TCPStore looks up the host name of every peer's address, IPv4-mapped (::ffff:127.0.0.1,
# which /etc/hosts never names), in its server's one event loop and in each client. The name server
# of the machines that run this project's CI drops queries when several come at once, and glibc
# then waits 5 s a lookup: a store connect over loopback takes 5 or 10 s, past the few seconds a
# unit test of the lobby allows its nodes to meet. A cluster's name server answers at once; so does
# none at all (the lookup fails at once), as here. Test-bed hosts keep their own resolv.conf.
if [ "$(id -u)" = 0 ] && [ -z "${PHALANX_NO_NAME_SERVER:-}" ] && [ -e /etc/resolv.conf ] \
	&& command -v unshare >/dev/null && unshare --mount true 2>/dev/null; then
	exec unshare --mount --propagation private sh -c \
		'mount --bind /dev/null /etc/resolv.conf || echo "no_name_server.sh: the name server stays" >&2
		PHALANX_NO_NAME_SERVER=1 exec "$@"' sh "$@"
fi
exec "$@"
