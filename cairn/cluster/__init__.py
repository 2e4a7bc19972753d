"""Everything Ray Serve: the Serve application (`app`), its two deployments (`engine_replica`,
`ingress`), request routing (`routing`: config, cost and ranking, the Serve routers, the index
handle), deploy configs (`deploy`) and the `cairn` CLI (`cli`). The HTTP API it serves is
`cairn.cluster.api`, which runs without Ray too.

Importing `cluster` imports nothing else (no Ray): each module pulls in what it needs.
"""
