"""How the HA check drives the job runner (examples/jobs/server.py):

python stack.py up -d --server examples.jobs.server
mcp-ha check http://127.0.0.1:8080/mcp --shape examples/jobs/ha_shape.py --faults local
"""

from mcp_ha.ops.check import Call, Shape

shape = Shape(
    write=Call("start_job", {"name": "probe", "steps": 1, "step_seconds": 0}),  # one job each
    read=Call("list_jobs"),
    count=lambda result: result["count"],
    # 25 steps of 0.15 s: progress for about four seconds; it creates one job, however often it is run.
    streamed=Call("start_job", {"name": "long", "steps": 25, "step_seconds": 0.15}),
)
