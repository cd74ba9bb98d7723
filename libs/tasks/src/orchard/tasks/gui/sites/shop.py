"""A shop: a catalog with search and categories, product pages, a cart and a checkout that
places an order. World: ``{"products": [{id, name, category, price_cents, description}]}``
(`make_catalog` for a seed). State: the cart, the orders placed and the searches made."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import quote

from .base import Request, Response, Site, esc

__all__ = ["Product", "ShopSite", "make_catalog"]

_CATEGORIES = ("Kitchen", "Garden", "Office", "Outdoor", "Toys")
_ADJECTIVES = (
    "Blue",
    "Compact",
    "Deluxe",
    "Folding",
    "Green",
    "Heavy",
    "Light",
    "Smart",
    "Steel",
    "Wooden",
    "Classic",
    "Mini",
)
_NOUNS = {
    "Kitchen": ("Kettle", "Teapot", "Knife Set", "Cutting Board", "Mixing Bowl", "Toaster"),
    "Garden": ("Watering Can", "Trowel", "Hose", "Planter", "Pruner", "Rake"),
    "Office": ("Desk Lamp", "Stapler", "Notebook", "Pen Holder", "Monitor Stand", "Chair Mat"),
    "Outdoor": ("Tent", "Lantern", "Backpack", "Camp Stool", "Water Bottle", "Hammock"),
    "Toys": ("Puzzle", "Kite", "Robot Kit", "Building Blocks", "Yo-yo", "Board Game"),
}
SHIPPING_CENTS = {"standard": 499, "express": 1499}


@dataclass(frozen=True)
class Product:
    id: str
    name: str
    category: str
    price_cents: int
    description: str


def make_catalog(seed: int | str, count: int = 24) -> list[Product]:
    """The shop's products for a seed: distinct names, prices between 3 and 150."""
    rng = random.Random(f"shop/{seed}")
    names: set[str] = set()
    products: list[Product] = []
    while len(products) < count:
        category = _CATEGORIES[len(products) % len(_CATEGORIES)]
        name = f"{rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS[category])}"
        if name in names:
            continue
        names.add(name)
        price = rng.randrange(300, 15000, 25)
        description = f"A {name.lower()} for everyday use. Ships in {rng.randint(1, 5)} days."
        products.append(Product(f"p{len(products) + 1:02d}", name, category, price, description))
    return products


def money(cents: int) -> str:
    return f"${cents / 100:,.2f}"


class ShopSite(Site):
    name = "shop"
    title = "Orchard Outfitters"
    description = "a shop: search, product pages, cart and checkout"

    @classmethod
    def make_world(cls, seed: int) -> dict[str, Any]:
        return {"products": product_dicts(seed)}

    def load(self, world: dict[str, Any]) -> None:
        self.catalog = [Product(**p) for p in world["products"]]
        if not self.catalog:
            raise ValueError("a shop needs at least one product")
        for product in self.catalog:
            if not isinstance(product.price_cents, int) or product.price_cents < 0:
                raise ValueError(f"product {product.id}: price_cents must be a whole number")
        self.by_id = {p.id: p for p in self.catalog}
        if len(self.by_id) != len(self.catalog):
            raise ValueError("product ids must be distinct")
        # Categories in the order the catalog first names them: the same page for the same world.
        self.categories = list(dict.fromkeys(p.category for p in self.catalog))
        self.cart: dict[str, int] = {}
        self.orders: list[dict[str, Any]] = []
        self.searches: list[str] = []

    def state(self) -> dict[str, Any]:
        return {
            "cart": [
                {"id": pid, "name": self.by_id[pid].name, "qty": qty}
                for pid, qty in self.cart.items()
            ],
            "orders": [dict(o) for o in self.orders],
            "searches": list(self.searches),
        }

    def nav(self) -> list[tuple[str, str]]:
        count = sum(self.cart.values())
        return [(self.href("/"), "Shop"), (self.href("/cart"), f"Cart ({count})")]

    def handle(self, request: Request) -> Response:
        path, method = request.path, request.method
        if path == "/" and method == "GET":
            return self._index(request)
        if path.startswith("/product/") and method == "GET":
            return self._product(path.removeprefix("/product/"), request)
        if path == "/cart" and method == "GET":
            return self._cart(request)
        if path == "/cart/add" and method == "POST":
            return self._add(request)
        if path == "/cart/remove" and method == "POST":
            self.cart.pop(request.field("id"), None)
            return Response.redirect(self.href("/cart"))
        if path == "/checkout" and method == "GET":
            return self._checkout_form({}, [])
        if path == "/checkout" and method == "POST":
            return self._place_order(request)
        if path.startswith("/order/") and method == "GET":
            return self._order(path.removeprefix("/order/"))
        return self.not_found(f"no page {path}")

    def _index(self, request: Request) -> Response:
        query = request.field("q")
        category = request.field("category")
        items = self.catalog
        if query:
            self.searches.append(query)
            items = [p for p in items if query.lower() in p.name.lower()]
        if category:
            items = [p for p in items if p.category == category]
        cats = " ".join(
            f'<a href="{self.href("/")}?category={esc(quote(c))}">{esc(c)}</a>'
            for c in self.categories
        )
        cards = "".join(
            f'<div class="card product" data-id="{p.id}"><h3>'
            f'<a href="{self.href("/product/" + p.id)}">{esc(p.name)}</a></h3>'
            f"<p>{esc(p.category)}</p><p class='price'>{money(p.price_cents)}</p>"
            f'<a class="button" href="{self.href("/product/" + p.id)}" '
            f'aria-label="View {esc(p.name)}">View</a></div>'
            for p in items
        )
        heading = f"Results for &ldquo;{esc(query)}&rdquo;" if query else "All products"
        if category:
            heading = esc(category)
        body = (
            f'<form method="get" action="{self.href("/")}"><input name="q" id="search" '
            f'aria-label="Search products" placeholder="Search products" value="{esc(query)}"> '
            f'<button type="submit">Search</button></form><p>Categories: {cats}</p>'
            f"<h1>{heading}</h1>"
            + (f'<div class="grid">{cards}</div>' if items else "<p>No products found.</p>")
        )
        return self.page("Shop", body)

    def _product(self, pid: str, request: Request) -> Response:
        product = self.by_id.get(pid)
        if product is None:
            return self.not_found(f"no product {pid}")
        body = (
            f"<h1>{esc(product.name)}</h1><p>{esc(product.description)}</p>"
            f"<p class='price'>Price: {money(product.price_cents)}</p>"
            f'<form method="post" action="{self.href("/cart/add")}">'
            f'<input type="hidden" name="id" value="{product.id}">'
            '<label for="qty">Quantity</label><input id="qty" name="qty" type="number" '
            'min="1" max="20" value="1"> <button type="submit" id="add">Add to cart</button></form>'
        )
        return self.page(product.name, body)

    def _add(self, request: Request) -> Response:
        product = self.by_id.get(request.field("id"))
        if product is None:
            return self.not_found("no such product")
        try:
            qty = max(1, min(20, int(request.field("qty", "1") or "1")))
        except ValueError:
            qty = 1
        self.cart[product.id] = min(20, self.cart.get(product.id, 0) + qty)
        return Response.redirect(self.href("/cart"))

    def _subtotal(self) -> int:
        return sum(self.by_id[pid].price_cents * qty for pid, qty in self.cart.items())

    def _cart(self, request: Request) -> Response:
        if not self.cart:
            body = (
                f'<h1>Your cart</h1><p>Your cart is empty.</p><a href="{self.href("/")}">Shop</a>'
            )
            return self.page("Cart", body)
        rows = "".join(
            f"<tr><td>{esc(self.by_id[pid].name)}</td><td>{qty}</td>"
            f"<td>{money(self.by_id[pid].price_cents * qty)}</td>"
            f'<td><form method="post" action="{self.href("/cart/remove")}">'
            f'<input type="hidden" name="id" value="{pid}">'
            '<button class="secondary" type="submit" '
            f'aria-label="Remove {esc(self.by_id[pid].name)}">Remove</button></form></td></tr>'
            for pid, qty in self.cart.items()
        )
        body = (
            "<h1>Your cart</h1><table><tr><th>Product</th><th>Quantity</th><th>Price</th>"
            f"<th></th></tr>{rows}</table><p>Subtotal: <b id='subtotal'>"
            f"{money(self._subtotal())}</b></p>"
            f'<a class="button" id="checkout" href="{self.href("/checkout")}">Checkout</a>'
        )
        return self.page("Cart", body)

    def _checkout_form(self, values: dict[str, str], errors: list[str]) -> Response:
        if not self.cart:
            return self.page("Checkout", "<h1>Checkout</h1><p>Your cart is empty.</p>")

        def text(name: str, label: str) -> str:
            return (
                f'<label for="{name}">{label}</label><input id="{name}" name="{name}" '
                f'size="40" value="{esc(values.get(name, ""))}">'
            )

        chosen = values.get("shipping", "standard")
        options = "".join(
            f'<option value="{k}"{" selected" if k == chosen else ""}>{k.title()} '
            f"({money(v)})</option>"
            for k, v in SHIPPING_CENTS.items()
        )
        error_html = "".join(f'<p class="error">{esc(e)}</p>' for e in errors)
        body = (
            f"<h1>Checkout</h1>{error_html}<p>Subtotal: {money(self._subtotal())}</p>"
            f'<form method="post" action="{self.href("/checkout")}">'
            + text("name", "Full name")
            + text("email", "Email")
            + text("address", "Street address")
            + text("city", "City")
            + f'<label for="shipping">Shipping</label><select id="shipping" name="shipping">'
            f"{options}</select><p><button type='submit' id='place'>Place order</button></p></form>"
        )
        return self.page("Checkout", body, 400 if errors else 200)

    def _place_order(self, request: Request) -> Response:
        if not self.cart:
            return self._checkout_form({}, [])
        values = {k: request.field(k) for k in ("name", "email", "address", "city", "shipping")}
        errors = [
            f"{label} is required"
            for key, label in (
                ("name", "Full name"),
                ("email", "Email"),
                ("address", "Street address"),
                ("city", "City"),
            )
            if not values[key]
        ]
        if values["email"] and "@" not in values["email"]:
            errors.append("Email must be an email address")
        if values["shipping"] not in SHIPPING_CENTS:
            errors.append("Choose a shipping option")
        if errors:
            return self._checkout_form(values, errors)
        items = [
            {
                "id": pid,
                "name": self.by_id[pid].name,
                "qty": qty,
                "price_cents": self.by_id[pid].price_cents,
            }
            for pid, qty in self.cart.items()
        ]
        order_id = f"ORD-{1001 + len(self.orders)}"
        self.orders.append(
            {
                "id": order_id,
                "items": items,
                **values,
                "subtotal_cents": self._subtotal(),
                "total_cents": self._subtotal() + SHIPPING_CENTS[values["shipping"]],
            }
        )
        self.cart.clear()
        return Response.redirect(self.href(f"/order/{order_id}"))

    def _order(self, order_id: str) -> Response:
        order = next((o for o in self.orders if o["id"] == order_id), None)
        if order is None:
            return self.not_found(f"no order {order_id}")
        rows = "".join(f"<li>{i['qty']} x {esc(i['name'])}</li>" for i in order["items"])
        body = (
            f"<h1>Thank you!</h1><p class='notice'>Order <b id='order-id'>{order_id}</b> is "
            f"placed. Total {money(order['total_cents'])}, shipping {esc(order['shipping'])} to "
            f"{esc(order['name'])}, {esc(order['city'])}.</p><ul>{rows}</ul>"
        )
        return self.page(f"Order {order_id}", body)


def product_dicts(seed: int | str) -> list[dict[str, Any]]:
    """The catalog as JSON (for task generators)."""
    return [asdict(p) for p in make_catalog(seed)]
