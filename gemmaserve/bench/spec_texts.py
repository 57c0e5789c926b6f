"""The input-grounded workload of `gemmaserve bench spec`: editing code, extracting and summarising
passages the prompt contains. Written as continuations (the embedded 270M is a base model): each prompt
ends where the model's answer begins, and the answer mostly repeats what the prompt holds, which is
where prompt lookup pays. Fixed here so that every run measures the same work."""

from __future__ import annotations

_CODE = '''def parse_orders(lines):
    orders = []
    for line in lines:
        fields = line.strip().split(",")
        if len(fields) != 4:
            continue
        order_id, customer, amount, currency = fields
        orders.append({"id": order_id, "customer": customer, "amount": float(amount), "currency": currency})
    return orders


def total_by_customer(orders):
    totals = {}
    for order in orders:
        totals[order["customer"]] = totals.get(order["customer"], 0.0) + order["amount"]
    return totals
'''

_PASSAGE = ("The river Elden rises in the northern hills and flows south for two hundred kilometres before it "
            "reaches the sea at Port Cary. In the eighteenth century its valley was known for water mills: by "
            "1790 there were forty-two of them between the hills and the coast, grinding grain for the growing "
            "towns. The railway arrived in 1851 and most of the mills closed within thirty years, but the old "
            "canal that ran beside the river was kept open for barges until 1934. Today the towpath is a walking "
            "route, and the mill at Hartley Bridge has been restored as a museum.")

_MEETING = ("Minutes of the planning meeting, 3 March. Present: Ana Ruiz (chair), Tom Becker, Priya Nair, Li Wei. "
            "Item 1: the new library opening moves from April to June because the shelving supplier is late. "
            "Item 2: the budget for the community garden is approved at 12,000 euros; Priya Nair will contact "
            "three contractors. Item 3: Tom Becker reports that the bus stop on Mill Street will be moved fifty "
            "metres north in May. Next meeting: 7 April at 18:00 in room 2.")

# Free text (stories, notes): no answer in the prompt; the 270M often repeats itself, so drafts still land,
# but less than above. The batch rows run both kinds: where drafting stops paying depends on it.
FREE_TEXT: list[str] = ["Once upon a time", "The history of the city begins", "In the morning the market",
                        "My favourite recipe is", "The scientists announced that", "Dear diary, today",
                        "The rules of the game are simple:", "At the edge of the forest"]

PROMPTS: dict[str, str] = {
    "code-rename": ("Here is a Python module:\n\n" + _CODE + "\nHere is the same module with the function "
                    "parse_orders renamed to read_orders and nothing else changed:\n\ndef read_orders(lines):\n"),
    "code-docstrings": ("Here is a Python module:\n\n" + _CODE + "\nHere is the same module, unchanged except "
                        "that each function now starts with a one-line docstring:\n\ndef parse_orders(lines):\n"
                        '    """Parse order lines."""\n'),
    "code-continue": ("# orders.py\n" + _CODE + "\n\n# orders_copy.py (an exact copy of orders.py)\n"
                      + _CODE[:120]),
    "extract-sentence": ("Passage: " + _PASSAGE + "\n\nQuestion: Which sentence of the passage says when the "
                         "railway arrived? Quote it exactly.\nAnswer: \""),
    "extract-facts": ("Passage: " + _PASSAGE + "\n\nThe passage again, one sentence per line:\n- The river Elden "
                      "rises in the northern hills"),
    "summary": ("Passage: " + _PASSAGE + "\n\nA summary of the passage in two sentences: The river Elden"),
    "minutes-actions": ("" + _MEETING + "\n\nThe minutes again, as a list of items:\n1. The new library opening"),
    "minutes-quote": (_MEETING + "\n\nWhat was decided about the budget for the community garden? Quote the "
                      "minutes.\nAnswer: \"Item 2:"),
}
