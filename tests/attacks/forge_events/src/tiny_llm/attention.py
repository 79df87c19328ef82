"""Attack: write "passed" for every collected test straight into the grader's event file, then exit."""
import json
import os


def _forge():
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if not target.endswith(".jsonl"):
            continue
        with open(target) as f:
            events = [json.loads(line.partition(" ")[2] or line) for line in f.read().splitlines()]
        items = next(e["items"] for e in events if e.get("event") == "collected")
        seq = len(events)
        with open(target, "a") as f:
            for nodeid in items:
                for event in ({"event": "start", "nodeid": nodeid},
                              {"event": "finish", "nodeid": nodeid, "outcome": "passed", "output": "", "duration": 0.1},):
                    f.write(f"{'0' * 64} {json.dumps({**event, 'seq': seq})}\n")
                    seq += 1
            f.write(f"{'0' * 64} {json.dumps({'event': 'session_finish', 'exitstatus': 0, 'seq': seq})}\n")
        os._exit(0)


_forge()
