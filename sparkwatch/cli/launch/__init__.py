"""`sparkwatch launch`, by its parts. The command (command.py) runs them in this order:

settlewait.py   wait while the pool is still handed back, here and on the engine's other nodes
docker.py       a container's engine, image, compose config and mounts, asked of docker before the plan
gather.py       what the plan needs, gathered: the pool, the model, the engines running, what was learned
nodes.py        each other node's share of an engine that spans nodes, from its agent or Ray
raycheck.py     what the engine's Ray cluster lacks: its raylets, stale placement groups
planview.py     the plan printed: lines, `--plan --json`
fix.py          `--fix`: the fixes that need no guessing
runner.py       the engine's run: declaration, boot phases, footprint, its end (incontainer.py: in a container)
supervise.py    the engine as launch's child: start, signals, reaping, the pass-through

The run's parts: anchorsearch.py (the boot-phase anchors in one pass), firsttoken.py (ready by the first token),
ranks.py (the ranks over Ray while it boots), treesample.py (what the tree holds), guardword.py (the guard's word).
"""
