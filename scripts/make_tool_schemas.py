#!/usr/bin/env python3
# ruff: noqa: E731, E741, E743  (one-letter schema builders keep each tool on one line)
"""Generates tandem/bench/data/tool_schemas.json: 100 function-calling tools shaped like
real agent tools (nested objects, enums, arrays, optional fields), from a fixed seed."""

import json
import random
from pathlib import Path

rng = random.Random(0)
S = lambda **k: {"type": "string", **k}
I = lambda lo=None, hi=None: {
    "type": "integer",
    **({"minimum": lo} if lo is not None else {}),
    **({"maximum": hi} if hi is not None else {}),
}
N = {"type": "number"}
B = {"type": "boolean"}
E = lambda *v: {"type": "string", "enum": list(v)}
A = lambda items, **k: {"type": "array", "items": items, **k}


def O(props, required=None, extra=False):
    o = {"type": "object", "properties": props}
    if required:
        o["required"] = required
    if not extra:
        o["additionalProperties"] = False
    return o


ADDRESS = O(
    {
        "street": S(),
        "city": S(),
        "postal_code": S(pattern="^[0-9]{5}$"),
        "country": E("US", "FR", "DE", "JP", "BR"),
    },
    ["city", "country"],
)
BASE = [
    (
        "get_weather",
        "Current weather for a location",
        O(
            {
                "location": S(description="City and country"),
                "unit": E("celsius", "fahrenheit"),
                "include_forecast": B,
                "days": I(1, 14),
            },
            ["location"],
        ),
    ),
    (
        "search_flights",
        "Search flights between airports",
        O(
            {
                "origin": S(pattern="^[A-Z]{3}$"),
                "destination": S(pattern="^[A-Z]{3}$"),
                "date": S(format="date"),
                "passengers": O({"adults": I(1, 9), "children": I(0, 9)}, ["adults"]),
                "cabin": E("economy", "premium", "business", "first"),
            },
            ["origin", "destination", "date"],
        ),
    ),
    (
        "create_calendar_event",
        "Create a calendar event",
        O(
            {
                "title": S(),
                "start": S(format="date-time"),
                "duration_minutes": I(5, 1440),
                "attendees": A(
                    O({"email": S(format="email"), "optional": B}, ["email"]), maxItems=20
                ),
                "reminder": {"anyOf": [{"type": "null"}, I(0, 10080)]},
            },
            ["title", "start"],
        ),
    ),
    (
        "send_email",
        "Send an email",
        O(
            {
                "to": A(S(format="email"), minItems=1, maxItems=10),
                "cc": A(S(format="email")),
                "subject": S(),
                "body": S(),
                "priority": E("low", "normal", "high"),
            },
            ["to", "subject", "body"],
        ),
    ),
    (
        "query_database",
        "Run a read-only SQL query",
        O(
            {
                "sql": S(),
                "database": E("analytics", "users", "billing"),
                "limit": I(1, 10000),
                "params": A({"anyOf": [S(), N, B, {"type": "null"}]}),
            },
            ["sql", "database"],
        ),
    ),
    (
        "create_ticket",
        "Open an issue in the tracker",
        O(
            {
                "title": S(),
                "description": S(),
                "labels": A(E("bug", "feature", "docs", "question")),
                "assignee": S(),
                "severity": E("p0", "p1", "p2", "p3"),
            },
            ["title", "severity"],
        ),
    ),
    (
        "book_restaurant",
        "Reserve a table",
        O(
            {
                "restaurant_id": S(),
                "party_size": I(1, 20),
                "time": S(format="date-time"),
                "seating": E("indoor", "outdoor", "bar"),
                "notes": S(),
            },
            ["restaurant_id", "party_size", "time"],
        ),
    ),
    (
        "web_search",
        "Search the web",
        O(
            {
                "query": S(),
                "num_results": I(1, 50),
                "site": S(),
                "recency": E("day", "week", "month", "any"),
            },
            ["query"],
        ),
    ),
    (
        "get_stock_quote",
        "Latest quote for a ticker",
        O(
            {"symbol": S(pattern="^[A-Z]{1,5}$"), "exchange": E("NYSE", "NASDAQ", "LSE", "TSE")},
            ["symbol"],
        ),
    ),
    (
        "translate_text",
        "Translate text",
        O(
            {
                "text": S(),
                "source_language": S(pattern="^[a-z]{2}$"),
                "target_language": S(pattern="^[a-z]{2}$"),
                "formality": E("formal", "informal", "default"),
            },
            ["text", "target_language"],
        ),
    ),
    (
        "update_user_profile",
        "Update a user's profile",
        O(
            {
                "user_id": I(1),
                "name": S(),
                "address": ADDRESS,
                "preferences": O(
                    {"newsletter": B, "theme": E("light", "dark", "system"), "language": S()}
                ),
            },
            ["user_id"],
        ),
    ),
    (
        "create_order",
        "Place an order",
        O(
            {
                "customer_id": S(),
                "items": A(
                    O({"sku": S(), "quantity": I(1, 100), "gift_wrap": B}, ["sku", "quantity"]),
                    minItems=1,
                ),
                "shipping_address": ADDRESS,
                "express": B,
            },
            ["customer_id", "items", "shipping_address"],
        ),
    ),
    (
        "run_code",
        "Execute a code snippet in a sandbox",
        O(
            {
                "language": E("python", "javascript", "bash"),
                "code": S(),
                "timeout_seconds": I(1, 300),
            },
            ["language", "code"],
        ),
    ),
    (
        "set_thermostat",
        "Set a thermostat",
        O(
            {
                "room": E("living_room", "bedroom", "kitchen", "office"),
                "temperature": N,
                "mode": E("heat", "cool", "auto", "off"),
            },
            ["room", "mode"],
        ),
    ),
    (
        "get_directions",
        "Route between two places",
        O(
            {
                "origin": S(),
                "destination": S(),
                "mode": E("driving", "walking", "bicycling", "transit"),
                "waypoints": A(S(), maxItems=8),
                "avoid": A(E("tolls", "highways", "ferries")),
            },
            ["origin", "destination"],
        ),
    ),
    (
        "summarize_document",
        "Summarize a document",
        O(
            {
                "document_id": S(),
                "max_words": I(10, 1000),
                "style": E("bullet_points", "paragraph", "tldr"),
                "focus_topics": A(S()),
            },
            ["document_id"],
        ),
    ),
    (
        "convert_currency",
        "Convert an amount between currencies",
        O(
            {
                "amount": N,
                "from_currency": S(pattern="^[A-Z]{3}$"),
                "to_currency": S(pattern="^[A-Z]{3}$"),
            },
            ["amount", "from_currency", "to_currency"],
        ),
    ),
    (
        "schedule_meeting",
        "Find a slot and schedule a meeting",
        O(
            {
                "participants": A(S(), minItems=2),
                "duration_minutes": I(15, 480),
                "window": O({"start": S(format="date"), "end": S(format="date")}, ["start", "end"]),
                "timezone": S(),
            },
            ["participants", "duration_minutes", "window"],
        ),
    ),
    (
        "get_news",
        "Headlines for a topic",
        O(
            {
                "topic": E("world", "business", "technology", "sports", "science"),
                "country": S(pattern="^[a-z]{2}$"),
                "page_size": I(1, 100),
            },
            ["topic"],
        ),
    ),
    (
        "manage_playlist",
        "Add or remove songs",
        O(
            {
                "playlist_id": S(),
                "action": E("add", "remove", "reorder"),
                "tracks": A(
                    O({"title": S(), "artist": S(), "position": I(0)}, ["title"]), minItems=1
                ),
            },
            ["playlist_id", "action", "tracks"],
        ),
    ),
    (
        "file_expense",
        "File an expense report",
        O(
            {
                "amount": N,
                "currency": S(pattern="^[A-Z]{3}$"),
                "category": E("travel", "meals", "lodging", "supplies", "other"),
                "receipt_url": S(),
                "split_with": A(O({"employee_id": I(1), "share": N}, ["employee_id", "share"])),
            },
            ["amount", "currency", "category"],
        ),
    ),
    (
        "control_lights",
        "Control smart lights",
        O(
            {
                "device_ids": A(S(), minItems=1),
                "power": E("on", "off"),
                "brightness": I(0, 100),
                "color": {"anyOf": [E("warm", "cool", "daylight"), S(pattern="^#[0-9a-f]{6}$")]},
            },
            ["device_ids", "power"],
        ),
    ),
    (
        "lookup_contact",
        "Find a contact",
        O({"name": S(), "fields": A(E("email", "phone", "address", "company"))}, ["name"]),
    ),
    (
        "create_reminder",
        "Create a reminder",
        O(
            {
                "text": S(),
                "when": S(format="date-time"),
                "repeat": {"anyOf": [{"type": "null"}, E("daily", "weekly", "monthly")]},
                "tags": A(S(), maxItems=5),
            },
            ["text", "when"],
        ),
    ),
    (
        "analyze_sentiment",
        "Sentiment of texts",
        O(
            {
                "texts": A(S(), minItems=1, maxItems=50),
                "granularity": E("document", "sentence"),
                "return_scores": B,
            },
            ["texts"],
        ),
    ),
]
OPTIONAL = [
    ("verbose", B),
    ("request_id", S()),
    ("locale", S(pattern="^[a-z]{2}-[A-Z]{2}$")),
    ("max_results", I(1, 100)),
    ("metadata", O({"source": E("web", "mobile", "api"), "trace": B})),
    ("tags", A(S(), maxItems=5)),
    ("dry_run", B),
]
tools = []
for k in range(100):
    name, desc, params = BASE[k % len(BASE)]
    params = json.loads(json.dumps(params))
    if k >= len(BASE):  # variants: more optional fields, a different name
        for key, schema in rng.sample(OPTIONAL, 1 + k % 3):
            params["properties"][key] = schema
        name = f"{name}_v{k // len(BASE) + 1}"
    tools.append(
        {"type": "function", "function": {"name": name, "description": desc, "parameters": params}}
    )
json.dump(
    tools,
    open(Path(__file__).resolve().parents[1] / "tandem/bench/data/tool_schemas.json", "w"),
    indent=1,
)
print(len(tools))
