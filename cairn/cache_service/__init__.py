"""Cluster-wide cache knowledge: the page hash everyone uses (`hashing`), what workers report
(`events`), and the index that learns from them (`index`). Imports nothing of ours outside it."""
