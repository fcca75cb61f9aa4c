"""A child for tests/test_zygote.py: reports what a fresh interpreter would see, then exits with the
code given."""

import json
import os
import sys

if __name__ == "__main__":
    print(
        json.dumps(
            {
                "argv": sys.argv[1:],
                "cwd": os.getcwd(),
                "probe": os.environ.get("ZYGOTE_PROBE"),
                "session_leader": os.getsid(0) == os.getpid(),
                "path0": sys.path[0],
                "strategy": __import__("parambox.strategies").strategies.STRATEGIES.get("toyz"),
                "torch_loaded": "torch" in sys.modules,
            }
        )
    )
    print("to stderr", file=sys.stderr)
    if sys.argv[1:] == ["threads"]:  # a parallel region on 2 threads: hangs if the zygote's pool leaked
        import torch

        print(torch.get_num_threads(), float(torch.ones(512, 512).mm(torch.ones(512, 512)).sum()), flush=True)
    if sys.argv[1:] == ["sleep"]:
        import time

        time.sleep(120)
    raise SystemExit(int(sys.argv[1]) if sys.argv[1:] and sys.argv[1].isdigit() else 0)
