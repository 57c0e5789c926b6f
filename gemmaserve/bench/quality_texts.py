"""The fixed texts and prompts of `gemmaserve bench quality`: our own writing (for this benchmark, so no
model has seen them verbatim). Perplexity, KL and argmax agreement run over every passage (each scored
from its start); greedy agreement over every prompt. The first passage and the first 24 prompts are
the sets of the earlier sessions' figures (BENCHMARKS.md quotes both)."""

# Twelve passages in different registers (story, science, instructions, letter, essay, news, a technical
# explanation, Python code, a review, dialogue, travel): 6,306 tokens. Over the first alone (453 tokens)
# the paired difference of two engines' log-likelihoods has a standard error of ~0.6% of perplexity,
# more than the gaps it was asked to rank; over all twelve ~0.17%.
PASSAGES = (
    """\
The harbour town woke before the sun. Fishermen carried nets down the stone steps, and the baker on the
corner pulled the first loaves from an oven that had burned since midnight. Nobody hurried; the tide
would wait for no one, but it would also not come in any sooner for being watched.

Mara had lived above the chandlery for eleven years. From her window she could see the breakwater, the
red light at its end, and beyond it the grey line where the sea met the sky. Every morning she wrote
down three things in a small notebook: the wind, the colour of the water, and the number of boats that
went out. Her neighbours thought it was a strange habit. She thought it was the only way to notice that
the world was changing, slowly, in ways that a single day would never show.

In the spring the notebook showed something odd. The boats went out as before, but fewer of them came
back before noon, and the ones that did came back light. The older fishermen blamed the weather. The
younger ones blamed the new trawlers that worked the deep water to the north. Mara did not blame anyone.
She took her notebook to the harbour master, a patient man with ink on his cuffs, and asked him to read
it.

He read it twice. Then he opened a drawer and took out a ledger of his own, with columns of dates and
weights going back thirty years. Together they laid the two books side by side on his desk and compared
them, page by page, until the light outside turned orange. When they had finished, neither of them
spoke for a while. The numbers agreed with each other, and what they said was not good news.

That evening the harbour master called a meeting in the church hall. He did not make a speech. He
simply read out the figures, one year after another, and let the room listen. When he sat down, an old
woman at the back stood up and said that her father had kept a notebook too, and that she still had it.
By the end of the week there were nine notebooks on the table, and a plan.
""",
    """\
The ferry was forty minutes late, and by the time it nosed against the pilings the light had gone the colour
of weak tea. Mara stood at the rail with her duffel bag between her boots, watching the dock hands loop thick
ropes around iron cleats that had been painted green at some point in the distant past.

Her brother was waiting at the bottom of the ramp. He had grown a beard since the spring, an uneven one that
made him look like he had been shipwrecked rather than simply busy.

"You brought the whole house," he said, lifting the bag and pretending to stagger.

"I brought three sweaters and a book. You told me the cottage had no heating."

"It has heating. It has a stove that heats one chair, if you sit very close to it."

They walked up the hill road together, past the shuttered bakery and the post office with its single crooked
flag. The island had a way of sounding empty even when it was not. Somewhere a dog barked twice and thought
better of it. A screen door slapped. Gulls argued over the harbour in voices that carried a long way in the
still air.

"Have you told Dad you're staying through the winter?" Mara asked.

Tomas shifted the bag to his other shoulder. "I sent him a postcard."

"A postcard."

"It had a lighthouse on it. I thought it softened the news."

She laughed despite herself, and the sound surprised her, because she had not laughed in the car on the way to
the harbour or on the long crossing, when she had sat inside the passenger cabin watching the grey water fold
over itself. She had spent the trip rehearsing what she would say to him, the careful sentences about money
and responsibility and how their father was not getting any younger.

Now, climbing the hill with the smell of woodsmoke drifting down from the chimneys, those sentences felt like
they belonged to someone else.

The cottage sat at the end of a gravel lane, low and white, with a vegetable patch that had clearly been
abandoned in August. Tomas pushed the door open with his shoulder.

"Welcome to the estate," he said.

Inside, the stove was lit, and one chair was pulled very close to it. Mara dropped into it without a word, and
her brother went to put the kettle on.
""",
    """\
A glacier looks like the most stubborn thing on Earth, a frozen mass that seems to sit in its valley for
centuries without changing. In fact, nearly every glacier is in motion, sliding and deforming under its own
enormous weight. The movement is usually too slow to see with the naked eye, often somewhere between a few
centimetres and a few metres per day, but over years it reshapes entire landscapes.

A glacier begins as snow that survives the summer. When more snow falls on top the following winter, the lower
layers are compressed. Air is squeezed out, the delicate crystals break down into rounded grains, and the
material gradually becomes a dense substance called firn. With further burial, firn turns into solid glacial
ice, which can look strikingly blue because thick ice absorbs red light more strongly than blue.

Once the ice is thick enough, usually several tens of metres, gravity begins to pull it downhill. There are
two main ways this happens. The first is internal deformation. Ice may feel brittle in your hand, but under
sustained pressure its crystals can slowly slip along internal planes, so the whole body of ice flows in a
manner somewhat like very stiff toffee. The ice near the surface moves faster than the ice near the bed, and
the centre of a valley glacier moves faster than its edges, where friction against the rock walls holds it
back.

The second mechanism is basal sliding. At the base of many glaciers, pressure and heat from friction and from
the ground below keep a thin film of liquid water in place. This water acts as a lubricant, allowing the
entire glacier to slide over its bed. When meltwater from the surface drains down through cracks and reaches
the base, sliding can speed up noticeably, which is one reason some glaciers move faster in summer.

The upper part of a glacier, where the ice is cold and not under great pressure, cannot flow smoothly. When
the ice below it stretches or bends over a bump in the bedrock, the surface cracks open into crevasses, some
of them deep enough to swallow a house.

As glaciers move, they pluck rocks from the bed and drag them along the ground beneath, carving U-shaped
valleys, polishing and scratching bedrock, and carrying debris that is eventually dumped as ridges of loose
material when the ice melts back.
""",
    """\
A flat tyre is the most common problem a cyclist will face, and fixing one at the roadside takes about fifteen
minutes once you have done it a few times. You will need a pair of tyre levers, a patch kit or a spare inner
tube, and a pump that fits your valve type. Work somewhere flat and out of the way of traffic.

1. Shift the chain onto the smallest rear cog if the puncture is in the back wheel. This makes it much easier
to remove and refit the wheel later.

2. Open the brake quick release if your bike has rim brakes, then undo the wheel's quick release lever or axle
nuts and lift the wheel out of the frame.

3. Let out any remaining air by pressing the valve core. On a narrow Presta valve you will need to unscrew the
small knurled nut at the tip first.

4. Hook one tyre lever under the edge of the tyre opposite the valve and pry it over the rim. Clip that lever
to a spoke, insert a second lever a few centimetres along, and slide it around the rim until one side of the
tyre is free.

5. Pull the inner tube out, leaving the valve until last. Pump a little air into it and listen or feel for the
escaping air. Passing the tube close to your lips or cheek is a surprisingly sensitive way to find a small
hole.

6. Before patching anything, run your fingers slowly around the inside of the tyre to find whatever caused the
puncture. A tiny shard of glass or a thorn left in place will simply cause another flat within minutes.

7. Roughen the area around the hole with the sandpaper from your kit, apply a thin layer of glue, and wait
until it turns from glossy to dull. Press the patch on firmly and hold it for a minute.

8. Put a small amount of air into the tube so it holds its shape, push the valve through the rim, and tuck the
tube evenly inside the tyre.

9. Starting at the valve, push the tyre bead back over the rim with your thumbs, working around both sides.
Try to avoid using levers for this step, because they can easily pinch the new tube.

10. Inflate to the pressure printed on the tyre sidewall, refit the wheel, close the brake, and spin the wheel
to check that it runs true.
""",
    """\
Dear Priya,

I have been meaning to write for weeks, and every evening I sit down with good intentions and end up
reorganising the spice drawer instead. So this is me, finally, at the kitchen table with a mug of something
that was hot an hour ago.

First, the big news: we moved. The new flat is on the third floor of a building that used to be a sewing
machine factory, and you can still see the marks on the floorboards where the heavy benches were bolted down.
The windows are enormous and the radiators are temperamental. One of them clanks every morning at exactly six,
which Daniel has decided is the ghost of a factory foreman calling the shift to start. I have decided it is a
plumbing problem, but I admit his version is more fun.

Work has been strange. They reorganised the whole department in March, and I now report to a man who sends
emails with no punctuation at all, not even full stops. Reading them is like being spoken to by someone who
never takes a breath. On the bright side, I have been given the community garden project I told you about last
year, so I spend two afternoons a week measuring raised beds and arguing with a supplier about the price of
compost.

How are you? How is the new job, and did you ever get the bathroom tiles you were agonising over? I still
think the green ones were right. I know you said they looked like a swimming pool from the seventies, but
sometimes that is exactly what a bathroom should look like.

I found the photo from our trip to the coast, the one where you are holding the enormous crab shell and
looking horrified. It is on the fridge now. Every time I open it for milk I laugh, and Daniel keeps asking for
the story, and I keep telling him he would not understand.

Are you still thinking of visiting in the autumn? We have a sofa bed now, a real one with a mattress that does
not fold you in half. The town has a market on Saturdays and a very good bakery, and I have already planned at
least three long walks that end at a pub.

Write back when you can, even a few lines. I miss our terrible phone calls where neither of us could hear
anything.

With love,
Hannah
""",
    """\
For most of recorded history, moving goods across the sea was slow, expensive, and labour intensive. A ship
arriving in port would be unloaded piece by piece: sacks of grain, barrels, crates of different sizes, bundles
of cloth. Teams of dock workers carried each item onto the quay, sorted it, and loaded it onto carts or
railway wagons. A ship might spend as long sitting at the dock as it did at sea, and theft and breakage were
routine costs of doing business.

The standard steel shipping container, which spread widely in the second half of the twentieth century,
changed this arrangement more than almost any other innovation of the period. The idea itself was simple.
Instead of handling thousands of separate items, goods would be packed into a box of fixed dimensions at the
factory, sealed, and not opened again until they reached their destination. The same box could be lifted from
a lorry onto a train, from a train onto a ship, and back again, by cranes designed to grip it at standard
corner fittings.

The economic effects were large and uneven. The cost of loading and unloading fell dramatically, and ships
could turn around in hours rather than days. Because transport became cheaper and more predictable, it became
practical for manufacturers to split production across several countries, making components in one place and
assembling them in another. Many economists argue that this shift in logistics did as much to expand
international trade as the reduction of tariffs did.

The change also had costs. Traditional ports built in the middle of old cities often lacked the space for huge
stacks of containers and the deep water needed by larger ships. New terminals were built elsewhere, sometimes
far from the original harbour, and districts that had depended on dock work for generations lost their main
source of employment in a remarkably short time. The number of workers needed to handle a given tonnage of
cargo fell sharply, and disputes over automation were common.

It is easy to think of economic history as a story of grand ideas and famous policies. The container is a
reminder that ordinary, practical standards can matter just as much. A box with agreed dimensions and fittings
was not glamorous, but by lowering the cost of distance it reshaped where things are made, which cities grow,
and what people in one part of the world can afford to buy from another.
""",
    """\
BRANWICK - Residents of Branwick packed the community hall on Thursday evening for a public meeting about the
future of the town's century-old footbridge, which was closed to pedestrians last month after an inspection
found serious corrosion in its supporting cables.

The bridge, which spans the River Tell between the market square and the Eastfield housing estate, is used by
an estimated eight hundred people a day, including many children walking to Eastfield Primary School. Since
the closure, those residents have faced a detour of nearly two kilometres by way of the road bridge on the
bypass.

Councillor Janet Orridge, who chairs the council's transport committee, told the meeting that a full
replacement would cost roughly 1.4 million pounds and could not begin before next spring. A cheaper repair
option, estimated at around 600,000 pounds, would reopen the bridge sooner but would need to be revisited
within fifteen years.

"We understand how disruptive this has been," Orridge said. "We are not going to put anyone at risk, but we
are also looking at every option for getting people across that river safely while the work is planned."

Several parents spoke about the difficulty of the longer route. Gemma Sallis, who lives in Eastfield with her
two sons, said the path along the bypass had no proper lighting and a narrow pavement. "In the winter it will
be dark by half past four," she said. "I'm not comfortable letting them walk that way alone, and I can't drive
them every day."

Local business owners also raised concerns. Ray Peddar, who has run a hardware shop on the market square for
twenty-two years, said his takings had fallen by about a fifth since the closure, because customers from the
estate were no longer passing his door.

The council said it was exploring a temporary shuttle bus between the estate and the town centre during school
hours and would consult a local rowing club about whether a supervised ferry crossing was practical. A
decision on whether to repair or replace the bridge is expected at the full council meeting on the fourteenth
of next month.

Members of the Branwick Civic Society, which has campaigned to preserve the bridge's original ironwork, said
they would submit a report favouring a careful restoration. The society's secretary, Alan Morrow, said the
group had collected more than three hundred signatures in the past fortnight.

Residents can view the engineering report at the library on Castle Street or on the council's website.
""",
    """\
A hash table stores pairs of keys and values in an array and uses a hash function to decide where each pair
should live. When you insert a key, the table computes a number from it, reduces that number to an index
within the array, usually by taking the remainder after dividing by the array length, and places the entry in
that slot. Looking the key up later repeats the same calculation, so in the typical case the table can jump
straight to the right position without searching.

The difficulty is that there are far more possible keys than there are slots. Two different keys will
sometimes produce the same index, a situation called a collision. Even with an excellent hash function,
collisions are unavoidable once the table holds a reasonable number of entries, so every practical
implementation needs a strategy for handling them.

The first common strategy is separate chaining. Each slot in the array holds not a single entry but a small
collection, often a linked list or a dynamic array. When two keys land in the same slot, both are simply added
to that slot's list. A lookup hashes the key, goes to the slot, and then walks the short list comparing keys
until it finds a match. Chaining is easy to implement and degrades gracefully, but each list node may live
somewhere different in memory, which can hurt cache performance.

The second strategy is open addressing. Here every entry lives directly in the array. If the slot chosen by
the hash is already occupied, the table probes other slots according to a fixed rule until it finds an empty
one. Linear probing checks the next slot, then the one after that, and so on. Quadratic probing jumps by
increasing distances, and double hashing uses a second hash function to choose the step size. Lookups follow
exactly the same probe sequence, stopping when they find the key or reach an empty slot. Deletion needs care:
simply clearing a slot could break the probe chain for other keys, so implementations often leave a special
marker, sometimes called a tombstone, in its place.

Both approaches rely on keeping the table from becoming too full. The ratio of stored entries to available
slots is called the load factor. As it rises, chains grow longer or probe sequences stretch out, and
performance drops. Most implementations therefore resize the array, typically doubling it, once the load
factor passes a threshold, and reinsert every entry using the new length.
""",
    '''\
"""Simple stock tracking for a small shop's storeroom.

Items are loaded from a CSV file with the columns sku, name, quantity and
reorder_level. The module can report which items need reordering and apply
batches of stock movements recorded during the day.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Item:
    """A single product line held in the storeroom."""

    sku: str
    name: str
    quantity: int
    reorder_level: int

    @property
    def needs_reorder(self) -> bool:
        """Return True when stock has fallen to or below the reorder level."""
        return self.quantity <= self.reorder_level


class Inventory:
    """A collection of items indexed by SKU."""

    def __init__(self) -> None:
        self._items: dict[str, Item] = {}

    @classmethod
    def from_csv(cls, path: Path) -> Inventory:
        """Build an inventory from a CSV file with a header row."""
        inventory = cls()
        with path.open(newline="", encoding="utf-8") as handle:
            for row in csv.DictReader(handle):
                inventory.add(
                    Item(
                        sku=row["sku"].strip(),
                        name=row["name"].strip(),
                        quantity=int(row["quantity"]),
                        reorder_level=int(row["reorder_level"]),
                    )
                )
        return inventory

    def add(self, item: Item) -> None:
        """Add a new item, refusing duplicate SKUs."""
        if item.sku in self._items:
            raise ValueError(f"duplicate SKU: {item.sku}")
        self._items[item.sku] = item

    def adjust(self, sku: str, delta: int) -> int:
        """Change the quantity of one item and return the new level.

        A negative delta records stock leaving the storeroom. Quantities are
        never allowed to drop below zero, since that would hide a counting error.
        """
        item = self._items[sku]
        new_quantity = item.quantity + delta
        if new_quantity < 0:
            raise ValueError(f"not enough {item.name} in stock to remove {-delta}")
        item.quantity = new_quantity
        return new_quantity

    def apply_movements(self, movements: list[tuple[str, int]]) -> None:
        """Apply a batch of (sku, delta) pairs in the order they occurred."""
        # Movements are applied one at a time, so a failure part way through
        # leaves the earlier adjustments in place for the caller to inspect.
        for sku, delta in movements:
            self.adjust(sku, delta)

    def reorder_list(self) -> list[Item]:
        """Return items that need reordering, lowest stock first."""
        low = [item for item in self._items.values() if item.needs_reorder]
        return sorted(low, key=lambda item: (item.quantity, item.name))


if __name__ == "__main__":
    import sys

    stock = Inventory.from_csv(Path(sys.argv[1]))
    for item in stock.reorder_list():
        # Pad the columns so the report lines up neatly in a terminal.
        print(f"{item.sku:<10} {item.name:<30} {item.quantity:>5}")
''',
    """\
I have used the Harrowgate Trail 28 daypack for four months, from short walks after work to a wet weekend in
the hills. It is a good pack with one or two irritating flaws, and whether it suits you will depend on how
much you value comfort over organisation.

Let me start with the best thing about it, which is the harness. The shoulder straps are wide and softly
padded without feeling bulky, and the back panel uses a mesh that sits a few centimetres away from your spine.
On a warm afternoon climb this makes a real difference. With my old pack I would arrive at the top with a
soaked shirt; with this one my back was merely damp. The hip belt is thin, more of a stabiliser than a load-
bearing belt, but for a pack of this size that seems reasonable.

The main compartment is a simple top-loading space with a zip that runs most of the way around, so you can
open it wide like a suitcase. This is genuinely useful when hunting for a buried sandwich. There is a sleeve
for a water bladder, two stretchy side pockets that actually hold a full-size bottle, and a large front pocket
for wet layers.

Now the complaints. The small lid pocket is oddly shaped, narrow at the top and wide at the bottom, and keys
and a phone tend to slide down into a corner where they are hard to reach. The zip pulls are small and
difficult to grab with gloves on, which matters in exactly the conditions where you most need to get into your
bag quickly. I tied loops of cord onto mine, which solved the problem, but I should not have had to.

The fabric has held up well so far. I have dragged it over rocks and stuffed it under bus seats, and apart
from some scuffing on the base it looks almost new. It is not waterproof, despite the marketing language about
weather resistance. In steady rain the contents of the main compartment stayed dry for about an hour, after
which I was glad I had packed a liner bag.

At its current price, it sits in the middle of the market. If you want lots of small pockets and organisers,
look elsewhere. If you want a comfortable, well-ventilated pack that you will soon forget you are wearing, I
would recommend it, along with a length of cord for the zips.

Four stars out of five.
""",
    """\
"You said it was a shortcut," Leo said.

"It is a shortcut," Nadia replied, without looking up from the map. "It is just also a field."

"A field full of cows."

"Cows are not a problem. Cows are basically large dogs that do not want anything from you."

Ruth, who had been walking behind them in silence, stopped at the gate and leaned on it. "Those are not cows,"
she said. "At least two of those are bulls."

Nadia lowered the map. "How can you possibly tell from here?"

"I grew up on a farm. Would you like me to describe the difference, or would you like to take my word for it?"

"Your word is fine," Leo said quickly.

They stood at the gate for a while. The animals in question had noticed them and were looking over with an
expression of mild interest that did not feel entirely friendly.

"Okay," Nadia said. "Options. We go back the way we came, which adds about forty minutes, or we follow the
hedge along the edge of the field, which is technically a public footpath."

"Technically," Ruth repeated.

"There is a sign. Look, a little yellow arrow."

"The arrow does not tell the bulls anything, Nadia."

Leo sat down on a flat stone by the gate and started unlacing his boot. "Whatever we decide, I need to get
this stone out of my sock. It has been there since the church."

"Since the church?" Nadia said. "That was two hours ago. Why didn't you say something?"

"Because every time I opened my mouth you told me we were nearly there."

Ruth laughed. "He has a point. You did say that. Four times, I think."

"Five," said Leo.

Nadia folded the map with some dignity. "Fine. I accept that my estimates have been optimistic. I do not
accept that my route is bad. It is a beautiful route."

"It is a beautiful route," Ruth agreed. "It is just that it goes through a field of bulls."

"So we go back?"

Ruth looked at the sky, at the low grey clouds gathering over the ridge, then at Leo, who was shaking a tiny
pebble out of his sock with an air of great relief.

"We go back," she said. "And on the way, Nadia, you can tell us again how close we are to the pub."

"Very close," Nadia said. "Genuinely. Very close."

Neither of them believed her, but they followed her anyway.
""",
    """\
The path leaves the village at the far end of the harbour wall and climbs almost immediately, cutting back and
forth across a slope of heather and loose stone. For the first half hour you hear little except your own
breathing and the occasional complaint of a sheep hidden somewhere in the bracken. Then the ground levels out,
the wind arrives all at once, and the whole western coast opens below you.

From the headland the sea looks less like water than like hammered metal, grey and silver and constantly
shifting. Far out, two uninhabited islands sit on the horizon, softened by haze. Closer in, the cliffs fall in
stages to a jumble of black rock where the swell breaks white, and the sound of it reaches you a moment late,
as if it had to climb.

In early summer the clifftop is thick with flowers. Pink clumps of thrift grow in cushions right to the edge,
and between them there are small yellow and blue flowers whose names I never remember, though I always mean to
look them up. Seabirds nest on the ledges below. If you lie flat and look over carefully, you can watch them
coming and going, tilting against the updraft, landing with their wings half open and a great deal of noise.

The path follows the coast north for about six kilometres. There is no shade and no shelter, and the weather
can change in minutes, turning a bright morning into a wall of drizzle that blows sideways off the sea. It is
worth carrying a proper jacket even when the sky looks clear from the village. It is also worth carrying more
water than you expect to need, because there is nowhere to refill a bottle.

Halfway along, the trail drops into a small sheltered cove with a shingle beach and the ruins of a stone hut,
roofless now, its doorway facing the sea. Visitors have built little stacks of flat pebbles along the wall. It
is the best place to stop for lunch, out of the wind, listening to the stones roll back and forth as each wave
withdraws.

The last stretch turns inland across open moor, where the ground is soft and the light seems to come from
everywhere at once. By the time you reach the road and the bus shelter at the crossroads, your legs will ache
and your face will be raw from the wind, and you will almost certainly already be planning to come back.
""",
)

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
    "The three primary colours are",
    "To make a cup of tea, first",
    "import numpy as np\n\n# Compute the mean of each row of a matrix\n",
    # Added 2026-12-04: six prompts decide greedy agreement by one or two near-ties; 24 give a count.
    "The water cycle describes how water moves between",
    "Here is a short list of fruits that are high in vitamin C:\n1.",
    "SELECT name, COUNT(*) FROM orders\n",
    "My grandmother always said that the secret to a good soup is",
    "The main difference between a virus and a bacterium is",
    "class Stack:\n    def __init__(self):\n",
    "Dear hiring manager,\n\nI am writing to apply for",
    "The first person to walk on the Moon was",
    "In mathematics, a prime number is",
    "Q: What is the boiling point of water at sea level?\nA:",
    "The train left the station at dawn, and",
    "for i in range(10):\n",
    "Photosynthesis is the process by which plants",
    "The recipe calls for two cups of flour, one egg and",
    "A good night's sleep helps the brain",
    "<html>\n<head>\n<title>",
    "The history of the printing press begins",
    "When the storm finally passed, the villagers",
    # Added 2026-12-05: 45 more (greedy agreement over 24 was still decided by a few near-ties).
    "The largest planet in the solar system is",
    "The chemical symbol for gold is",
    "At sea level, water boils at a temperature of",
    "The human heart has four chambers, called the",
    "The Pacific Ocean is the largest ocean on Earth, covering",
    "A triangle with three equal sides is called",
    "The speed of light in a vacuum is approximately",
    "The old lighthouse keeper had not spoken to anyone in weeks, until one morning",
    "It was raining the night the stranger arrived at the inn. He",
    "When Maya opened the letter, her hands began to",
    "The robot looked at the broken vase and said,",
    "To change a flat tyre on a car, you should first",
    "Before painting a wall, it is important to",
    "The best way to learn a new programming language is to",
    "import json\n\ndef load_config(path):\n",
    "function add(a, b) {\n",
    "const numbers = [1, 2, 3, 4, 5];\nconst doubled = numbers.map(",
    "SELECT name, email\nFROM users\nWHERE",
    "#!/bin/bash\n# Back up the home directory\ntar -czf",
    "Three reasons to learn a second language:\n1.",
    "Ingredients for a simple pancake batter:\n-",
    "Q: What is the boiling point of water in Fahrenheit?\nA:",
    "Q: Who wrote the play Romeo and Juliet?\nA:",
    "Q: How many days are there in a leap year?\nA:",
    "Dear Sir or Madam,\n\nI am writing to",
    "Dear Grandma,\n\nThank you so much for the",
    "In economics, inflation refers to",
    "The French Revolution began in the year",
    "Mount Everest is located on the border between",
    "An adjective is a word that",
    "The opposite of hot is cold, and the opposite of tall is",
    "Monday, Tuesday, Wednesday,",
    "1, 2, 3, 5, 8, 13,",
    "Translate to French: Good morning, how are you?\nFrench:",
    "Summary: The meeting was postponed because",
    "Step 1: Preheat the oven to 180 degrees.\nStep 2:",
    "git checkout -b feature/login\ngit add .\ngit commit -m",
    "The Great Wall of China was built to",
    "A healthy breakfast might include",
    "The moral of the story is that",
    "Gravity is the force that",
    "Dogs make good pets because they are loyal, friendly, and",
    "The Amazon rainforest is home to",
    "To reverse a list in Python, you can use",
    "Subject: Meeting next week\n\nHi team,\n\nJust a quick reminder that",
)
