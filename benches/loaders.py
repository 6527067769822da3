"""One timed measurement of one loader, run in a fresh process by run.py.

The peer drivers live in the package (``fastload._peers``), where ``fastload bench --compare``
uses them too; this script only runs them:

    python benches/loaders.py '{"loader": "safetensors", "workload": "load", "files": [...], ...}'
"""

from __future__ import annotations

from fastload._peers import main

if __name__ == "__main__":
    main()
