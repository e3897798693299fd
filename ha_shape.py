"""How the HA check drives the demo server (server.py):

python stack.py up -d
mcp-ha check http://127.0.0.1:8080/mcp --shape ha_shape.py --faults local
"""

from mcp_ha.ops.check import Call, Shape

shape = Shape(
    write=Call("increment_counter"),  # one more on the session's counter
    read=Call("get_counter"),
    count=lambda result: result["counter"],
    # 60 items at 0.05 s each: three seconds of progress; it leaves the counter as it was.
    streamed=Call("analyze_data", {"num_items": 60}),
)
