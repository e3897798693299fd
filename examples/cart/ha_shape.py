"""How the HA check drives the cart (examples/cart/server.py):

python stack.py up -d --server examples.cart.server
mcp-ha check http://127.0.0.1:8080/mcp --shape examples/cart/ha_shape.py --faults local
"""

from mcp_ha.ops.check import Call, Shape


def apples(result: dict) -> int:
    """Every apple the session added: in its cart, or in an order a checkout placed."""
    return result["items"].get("apple", 0) + sum(order["items"].get("apple", 0) for order in result["orders"])


shape = Shape(
    write=Call("add_item", {"sku": "apple", "qty": 1}),
    read=Call("view_cart"),
    count=apples,
    # A checkout sent twice places one order: the cart and the orders are what one checkout leaves.
    once=Call("checkout"),
    state=lambda result: (result["items"], [order["items"] for order in result["orders"]]),
)
