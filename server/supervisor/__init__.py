"""The engine supervisor: runs the engine (`vllm serve ...`) as a child process group and keeps it serving.

The engine listens on a Unix socket in the run directory (0700), fresh for each start, never on a TCP port
(sockets.py says why and how vLLM binds it, and where the socket goes when the run directory's path is too long
for one); every request to it carries its per-start key.

The API process never imports vLLM: the engine runs under a small watchdog, the supervisor's direct child, in
a session of its own (so vLLM's workers share one process group that is signalled at once), watched through its
`/health` and its exit. The watchdog ends the whole group when the wrapper dies, whatever kills it (parent-death
signal); a pid file in the run directory lets the next wrapper of the same cache directory stop an engine a
previous one left (recognised by pid and process start time, never by name). A crash in the engine costs a
restart with exponential backoff, never the API; so does an engine that stops answering its liveness probes.

Its parts, each importing only those above it:
- command: the plan's engine command and environment, and why a plan is refused;
- processes: process groups read from /proc, and ended;
- watchdog: the engine's direct child, shipped to `python -c` as source;
- sockets: the Unix socket the engine listens on;
- probes: the liveness probes, over that socket;
- run_dir: the pid files of running engines, the sweep of those a killed wrapper left, the early engine's
  environment;
- status: the engine's states and what /status reports of them;
- early: the first engine of an edge-serve, started before its plan is made;
- supervisor: EngineSupervisor, which starts, watches, restarts and stops the engine.
"""
