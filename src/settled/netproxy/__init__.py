"""The network proxy of a home: the only way out of a task's network namespace, and the ledger
of every connection that took it (issue 35).

A command run with `--network proxy` (the default) joins its task's network namespace, which
holds its loopback and nothing else: no interface, no route. Its one way out is an HTTP(S)
proxy that settled runs outside that namespace, one daemon per home, listening inside each
task's namespace on 127.0.0.1:3128 (netpolicy.PROXY_PORT) through a socket made there and held
outside (`taskns`: a forked helper enters the namespace, makes the listener and hands it back);
the command finds it through HTTP_PROXY, HTTPS_PROXY, ALL_PROXY and their lower-case forms.

Each connection is judged before a byte leaves (`relay`): whose it is (the kernel's cgroup v2
id of the peer socket, asked through a sock_diag socket of the task's namespace: the session
that made it, never what the command says), where it asks to go (CONNECT host:port, or a plain
HTTP request's absolute URI), and the session's `--allow-host` patterns (netpolicy.decide). It
is refused with 403 and recorded, or connected and recorded with its bytes each way and how it
ended, in the session's ledger (netledger.py), which only this daemon writes and the session's
owner seals after its death evidence.

One duty per module:
- `client`: the wire protocol (`ping`, `serve`, `seal`, `release`, `stop`). Standard library
  only: an owner seals its ledger after evidence without loading the rest.
- `lifecycle`: the daemon started once per home (a start lock), `serve` and `seal` for callers.
- `taskns`: a listener and a sock_diag socket made inside a task's network namespace.
- `relay`: one connection, from its request head to its end.
- `daemon`: the control socket, the task listeners, sessions and their ledgers, limits.

Must never: forward a byte for a connection it could not attribute to a live session of the
listener's task, or write a ledger line the command could have influenced beyond what it asked.
"""
