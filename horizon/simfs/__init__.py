"""A simulated Unix file system and shell for the `terminal` task domain, in three parts:

    horizon.simfs.fs     SimFS (an in-memory tree with a cwd), SimFSError, MAX_NODES
    horizon.simfs.shell  Terminal, the `terminal` tool: a shell-like command language over a SimFS
    horizon.simfs.tree   seeded_tree(seed, n_files), deterministic project-like trees for task generators

Nothing here touches the real disk or the clock. From the rest of Horizon it needs only the agent's tool
interface (`horizon.agent.tool`).
"""

# Import order matters: `horizon.agent` (its __init__ and registry) imports Terminal from
# `horizon.simfs.shell`, and shell.py imports `horizon.agent.tool`, which runs `horizon/agent/__init__.py`
# first. Loading `horizon.agent` here, before `.shell`, lets that __init__ import shell.py whole when this
# package is imported first; when `horizon.agent` was imported first, this line is a no-op. So `horizon.agent`
# imports the submodules (`horizon.simfs.shell`, ...), never this package's names.
import horizon.agent.tool  # noqa: F401
from horizon.simfs.fs import MAX_NODES, SimFS, SimFSError
from horizon.simfs.shell import Terminal
from horizon.simfs.tree import seeded_tree

__all__ = ["MAX_NODES", "SimFS", "SimFSError", "Terminal", "seeded_tree"]
