"""The command a local cluster starts each engine with: ipyparallel's engine, after importing
torch and the rank's code (workbench.distributed.engine), the longest part of an engine's
start. Cluster.start launches these engines beside the controller instead of after it, so
the import overlaps the controller's start; each engine then waits for the controller's
connection file (ipyparallel's IPEngine.wait_for_url_file) and registers. What a rank does
at start (pinning, memory binding, threads, kernels) still happens in engine.prepare."""

import workbench.distributed.engine  # noqa: F401  (imports torch)
from ipyparallel.engine.app import main

if __name__ == "__main__":
    main()
