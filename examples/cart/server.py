"""A shopping cart that survives its replica: a second server shape, written only against `mcp_ha`.

    python stack.py up -d --server examples.cart.server

Each session has one cart (`cart`: sku -> quantity) and its orders. Every tool
that changes the cart reads it first, so it changes it in an apply-once block
(`Session.apply_once`): the writes commit together, only if the cart is still
what the block read, and a retried call answers with the first run's result
instead of applying again. So a checkout that is sent twice, or whose replica
dies half-way, places one order.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastmcp import Context
from fastmcp.exceptions import ToolError
from pydantic import Field

from mcp_ha import HighAvailability, SessionHandle, Transaction

ha = HighAvailability.from_env()
mcp = ha.server("cart")

# Price in cents by sku: the catalogue every replica shares, because it is code.
CATALOGUE = {"apple": 50, "bread": 250, "cheese": 700, "coffee": 900}
Sku = Annotated[str, Field(description=f"One of: {', '.join(CATALOGUE)}.")]
Quantity = Annotated[int, Field(ge=1, le=100, description="How many (1-100).")]


def _priced(cart: dict[str, int]) -> dict[str, Any]:
    return {"items": cart, "total_cents": sum(CATALOGUE[sku] * qty for sku, qty in cart.items())}


@mcp.tool
async def add_item(sku: Sku, qty: Quantity, ctx: Context, session_id: SessionHandle = None) -> dict:
    """Put `qty` of `sku` in this session's cart; the cart after."""
    if sku not in CATALOGUE:
        raise ToolError(f"Unknown sku {sku!r}; the catalogue has {', '.join(CATALOGUE)}.")
    session = await ha.session(ctx, session_id)

    async def add(tx: Transaction) -> dict:
        cart = await tx.get("cart", {})
        cart[sku] = cart.get(sku, 0) + qty
        tx.set("cart", cart)
        return _priced(cart)

    return {**await session.apply_once(add), "instance": ha.instance}


@mcp.tool
async def remove_item(sku: Sku, ctx: Context, session_id: SessionHandle = None) -> dict:
    """Take `sku` out of this session's cart, whatever its quantity; the cart after."""
    session = await ha.session(ctx, session_id)

    async def remove(tx: Transaction) -> dict:
        cart = await tx.get("cart", {})
        cart.pop(sku, None)
        tx.set("cart", cart)
        return _priced(cart)

    return {**await session.apply_once(remove), "instance": ha.instance}


@mcp.tool(annotations={"readOnlyHint": True})
async def view_cart(ctx: Context, session_id: SessionHandle = None) -> dict:
    """This session's cart and its orders so far."""
    session = await ha.session(ctx, session_id)
    state = await session.items()
    return {**_priced(state.get("cart", {})), "orders": state.get("orders", []), "instance": ha.instance}


@mcp.tool
async def checkout(ctx: Context, session_id: SessionHandle = None) -> dict:
    """Turn the cart into an order and empty it; the order. Placed once, however often it is sent."""
    session = await ha.session(ctx, session_id)

    async def place(tx: Transaction) -> dict:
        cart = await tx.get("cart", {})
        if not cart:
            return {"order": None, "reason": "the cart is empty"}
        orders = await tx.get("orders", [])
        order = {"number": len(orders) + 1, **_priced(cart)}
        tx.append("orders", order)
        tx.delete("cart")
        return {"order": order}

    return {**await session.apply_once(place), "instance": ha.instance}


app = ha.http_app(mcp)

if __name__ == "__main__":
    ha.run(app)
