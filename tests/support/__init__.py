"""What the tests share that is not a fixture (fixtures: `tests/conftest.py`): checkpoints to
build, fake engine clients, chat drivers, checks on a real Ray cluster, and the scenario scripts
that run a multi-node or autoscaling cluster in a process of their own. Imported as
`tests.support.<module>`: `tests/` is a package (each folder has an `__init__.py`), so that its
folders named like ours (`tests/workers/`, `tests/cluster/`) never shadow the real packages."""
