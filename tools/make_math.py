#!/usr/bin/env python3
"""Generate edgeflow's grade-school math sets deterministically.

Writes two JSONL files, one {"question": ..., "answer": ...} object per line:

* corpora/math.jsonl  (seed 1) - training / calibration text
* eval/math.jsonl     (seed 2) - held-out evaluation items

Every number in a question is drawn from a seeded random generator and every
answer is computed from those numbers, so the worked solutions are correct by
construction. Each answer is a short step-by-step solution whose last line is
"The answer is N." with N an integer.

The held-out set is built from its own question templates (same broad skills:
shopping, rates, areas, percentages, ages, fractions, equations), and the script
refuses to write it if any eval question equals a corpus question or if any
8-word shingle of an eval item also occurs in the corpus.

Usage:  python3 -m tools.make_math [--corpus-n 220] [--eval-n 340]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
from pathlib import Path

HERE = Path(__file__).resolve().parents[1] / "data"  # what it writes: data/corpora/ and data/eval/

PEOPLE = [
    ("Maya", "she", "her"), ("Liam", "he", "his"), ("Aisha", "she", "her"),
    ("Carlos", "he", "his"), ("Priya", "she", "her"), ("Tom", "he", "his"),
    ("Yuki", "she", "her"), ("Omar", "he", "his"), ("Elena", "she", "her"),
    ("Ben", "he", "his"), ("Zara", "she", "her"), ("Kofi", "he", "his"),
    ("Lucia", "she", "her"), ("Sam", "he", "his"), ("Nina", "she", "her"),
    ("Jamal", "he", "his"), ("Hana", "she", "her"), ("Leo", "he", "his"),
    ("Grace", "she", "her"), ("Mateo", "he", "his"), ("Ivy", "she", "her"),
    ("Ravi", "he", "his"), ("Chloe", "she", "her"), ("Felix", "he", "his"),
]


def person(rng: random.Random):
    return rng.choice(PEOPLE)


def two_people(rng: random.Random):
    a, b = rng.sample(PEOPLE, 2)
    return a, b


def money(x: int) -> str:
    return f"${x}"


# --------------------------------------------------------------------------
# Corpus templates (seed 1). Each returns (question, [steps], integer answer).
# --------------------------------------------------------------------------

def c_shop_total(rng):
    name, pr, _ = person(rng)
    item = rng.choice(["notebooks", "folders", "markers", "rulers", "erasers"])
    n, p, q = rng.randint(2, 9), rng.randint(2, 8), rng.randint(1, 5)
    t1 = n * p
    q_text = (f"{name} buys {n} {item} at {money(p)} each and a pen for {money(q)}. "
              f"How much does {pr} spend in total?")
    steps = [f"The {item} cost {n} × {p} = {t1} dollars.",
             f"Adding the pen gives {t1} + {q} = {t1 + q} dollars."]
    return q_text, steps, t1 + q


def c_shop_change(rng):
    name, pr, _ = person(rng)
    food = rng.choice(["sandwiches", "muffins", "smoothies", "burritos", "salads"])
    bill = rng.choice([20, 50, 100])
    while True:
        n, p = rng.randint(2, 6), rng.randint(3, 12)
        if n * p < bill:
            break
    cost = n * p
    q_text = (f"{name} pays with a {money(bill)} bill for {n} {food} that cost {money(p)} each. "
              f"How much change should {pr} get back?")
    steps = [f"The {food} cost {n} × {p} = {cost} dollars in total.",
             f"The change is {bill} − {cost} = {bill - cost} dollars."]
    return q_text, steps, bill - cost


def c_shop_discount(rng):
    thing = rng.choice(["jacket", "backpack", "lamp", "pair of boots", "desk chair", "tent"])
    price = rng.randint(2, 15) * 20
    pct = rng.choice([10, 15, 20, 25, 30, 40, 50])
    off = price * pct // 100
    q_text = (f"A {thing} normally costs {money(price)}. This week it is {pct}% off. "
              f"What is the sale price in dollars?")
    steps = [f"The discount is {pct}% of {price}, which is {price} × {pct} / 100 = {off} dollars.",
             f"The sale price is {price} − {off} = {price - off} dollars."]
    return q_text, steps, price - off


def c_unit_price(rng):
    item = rng.choice(["pencils", "batteries", "candles", "light bulbs", "stickers"])
    n = rng.choice([4, 5, 6, 8, 10, 12])
    u = rng.randint(1, 6)
    m = rng.randint(n + 1, 60)
    q_text = (f"A pack of {n} {item} costs {money(n * u)}. At the same price per item, "
              f"how much would {m} {item} cost?")
    steps = [f"Each of the {item} costs {n * u} / {n} = {u} dollars.",
             f"So {m} of them cost {m} × {u} = {m * u} dollars."]
    return q_text, steps, m * u


def c_speed_distance(rng):
    vehicle = rng.choice(["train", "bus", "ferry", "truck", "car"])
    s, h = rng.randint(4, 24) * 5, rng.randint(2, 7)
    q_text = f"A {vehicle} travels at a steady {s} km/h for {h} hours. How many kilometers does it cover?"
    steps = ["Distance equals speed multiplied by time.",
             f"{s} × {h} = {s * h} kilometers."]
    return q_text, steps, s * h


def c_time_from_distance(rng):
    name, pr, _ = person(rng)
    s, h = rng.randint(10, 25), rng.randint(2, 6)
    d = s * h
    q_text = f"{name} cycles {d} km at an average speed of {s} km/h. How many hours does the ride take?"
    steps = ["Time equals distance divided by speed.",
             f"{d} / {s} = {h} hours."]
    return q_text, steps, h


def c_printer(rng):
    r = rng.randint(8, 40)
    t = rng.randint(3, 20)
    p = r * t
    q_text = f"A printer prints {r} pages per minute. How many minutes does it need to print {p} pages?"
    steps = [f"Divide the number of pages by the pages printed each minute: {p} / {r} = {t}."]
    return q_text, steps, t


def c_tank(rng):
    r = rng.randint(3, 15)
    x = rng.randint(2, 30) * r
    t = rng.randint(5, 40)
    c = x + r * t
    q_text = (f"A tank holds {c} liters and already contains {x} liters. A hose adds {r} liters "
              f"per minute. How many minutes until the tank is full?")
    steps = [f"The tank still needs {c} − {x} = {c - x} liters.",
             f"At {r} liters per minute that takes {c - x} / {r} = {t} minutes."]
    return q_text, steps, t


def c_wages(rng):
    name, pr, _ = person(rng)
    w, h, d = rng.randint(12, 30), rng.randint(3, 8), rng.randint(2, 6)
    q_text = (f"{name} earns {money(w)} per hour and works {h} hours a day for {d} days. "
              f"How much does {pr} earn altogether?")
    steps = [f"Each day {pr} earns {w} × {h} = {w * h} dollars.",
             f"Over {d} days that is {w * h} × {d} = {w * h * d} dollars."]
    return q_text, steps, w * h * d


def c_rect_area(rng):
    place = rng.choice(["garden", "classroom floor", "parking lot", "vegetable plot", "patio"])
    l, w = rng.randint(5, 30), rng.randint(3, 20)
    q_text = f"A rectangular {place} is {l} meters long and {w} meters wide. What is its area in square meters?"
    steps = ["The area of a rectangle is length times width.",
             f"{l} × {w} = {l * w} square meters."]
    return q_text, steps, l * w


def c_fence_cost(rng):
    l, w, c = rng.randint(6, 25), rng.randint(4, 18), rng.randint(3, 12)
    p = 2 * (l + w)
    q_text = (f"A farmer wants to fence a rectangular field that is {l} m by {w} m. Fencing costs "
              f"{money(c)} per meter. How much will the fence cost?")
    steps = [f"The perimeter is 2 × ({l} + {w}) = {p} meters.",
             f"The cost is {p} × {c} = {p * c} dollars."]
    return q_text, steps, p * c


def c_tile_boxes(rng):
    l, w = rng.randint(3, 12), rng.randint(3, 10)
    b = rng.choice([2, 3, 4, 5])
    area = l * w
    boxes = math.ceil(area / b)
    q_text = (f"A room measures {l} m by {w} m. One box of floor tiles covers {b} square meters. "
              f"How many boxes are needed to cover the whole floor?")
    steps = [f"The floor area is {l} × {w} = {area} square meters.",
             f"{area} / {b} = {area / b:g}, and a part box cannot be bought, so round up to {boxes} boxes."
             if area % b else f"{area} / {b} = {boxes} boxes exactly."]
    return q_text, steps, boxes


def c_triangle_area(rng):
    b, h = rng.randint(2, 15) * 2, rng.randint(3, 20)
    q_text = f"A triangle has a base of {b} cm and a height of {h} cm. What is its area in square centimeters?"
    steps = ["The area of a triangle is one half of base times height.",
             f"{b} × {h} = {b * h}, and half of {b * h} is {b * h // 2} square centimeters."]
    return q_text, steps, b * h // 2


def c_box_volume(rng):
    l, w, h = rng.randint(2, 15), rng.randint(2, 12), rng.randint(2, 10)
    q_text = (f"A storage box is {l} cm long, {w} cm wide and {h} cm tall. "
              f"What is its volume in cubic centimeters?")
    steps = ["Volume of a box is length × width × height.",
             f"{l} × {w} = {l * w}, and {l * w} × {h} = {l * w * h} cubic centimeters."]
    return q_text, steps, l * w * h


def c_percent_of_group(rng):
    n = rng.randint(2, 20) * 20
    p = rng.choice([5, 10, 15, 20, 25, 30, 35, 40, 45, 55, 60, 65, 70, 75, 80, 85, 90])
    act = rng.choice(["walk to school", "take the bus", "play an instrument", "ride a bike to school"])
    k = n * p // 100
    q_text = f"A school has {n} students and {p}% of them {act}. How many students {act}?"
    steps = [f"{p}% of {n} is {n} × {p} / 100.",
             f"{n} × {p} = {n * p}, and {n * p} / 100 = {k}."]
    return q_text, steps, k


def c_percent_increase(rng):
    thing = rng.choice(["The price of a bus pass", "A town's population", "The rent on a small shop",
                        "The number of members in a club"])
    a = rng.randint(2, 40) * 20
    p = rng.choice([5, 10, 15, 20, 25, 30, 50])
    inc = a * p // 100
    q_text = f"{thing} was {a} last year and rose by {p}% this year. What is it now?"
    steps = [f"The increase is {p}% of {a}: {a} × {p} / 100 = {inc}.",
             f"The new value is {a} + {inc} = {a + inc}."]
    return q_text, steps, a + inc


def c_test_percent(rng):
    name, pr, _ = person(rng)
    t = rng.choice([20, 25, 40, 50])
    c = rng.randint(t // 2, t)
    while (c * 100) % t:
        c = rng.randint(t // 2, t)
    pct = c * 100 // t
    q_text = f"{name} answered {c} out of {t} quiz questions correctly. What percentage did {pr} get right?"
    steps = [f"The fraction correct is {c}/{t}.",
             f"As a percentage: {c} / {t} × 100 = {pct}%."]
    return q_text, steps, pct


def c_age_times(rng):
    (a, _, _), (b, _, _) = two_people(rng)
    k, bage, y = rng.randint(2, 4), rng.randint(3, 12), rng.randint(2, 10)
    q_text = (f"{a} is {k} times as old as {b}. {b} is {bage} years old. "
              f"How old will {a} be in {y} years?")
    steps = [f"{a} is now {k} × {bage} = {k * bage} years old.",
             f"In {y} years {a} will be {k * bage} + {y} = {k * bage + y}."]
    return q_text, steps, k * bage + y


def c_age_sum(rng):
    (a, _, _), (b, _, _) = two_people(rng)
    younger, d = rng.randint(5, 40), rng.randint(1, 15)
    s = 2 * younger + d
    older = younger + d
    q_text = (f"The ages of {a} and {b} add up to {s}. {a} is {d} years older than {b}. "
              f"How old is {a}?")
    steps = [f"Let {b}'s age be x. Then {a}'s age is x + {d}.",
             f"x + (x + {d}) = {s}, so 2x = {s - d} and x = {younger}.",
             f"{a} is {younger} + {d} = {older} years old."]
    return q_text, steps, older


def c_age_past(rng):
    name, pr, _ = person(rng)
    ago, then, ahead = rng.randint(2, 9), rng.randint(4, 30), rng.randint(2, 12)
    now = then + ago
    q_text = f"{ago} years ago {name} was {then} years old. How old will {pr} be {ahead} years from now?"
    steps = [f"{name}'s age now is {then} + {ago} = {now}.",
             f"In {ahead} years {pr} will be {now} + {ahead} = {now + ahead}."]
    return q_text, steps, now + ahead


def c_fraction_give(rng):
    name, pr, _ = person(rng)
    thing = rng.choice(["marbles", "stickers", "trading cards", "seashells", "stamps"])
    q = rng.choice([3, 4, 5, 6, 8])
    p = rng.choice([k for k in range(1, q) if math.gcd(k, q) == 1])
    n = q * rng.randint(3, 15)
    gone = n * p // q
    q_text = f"{name} had {n} {thing} and gave away {p}/{q} of them. How many {thing} does {pr} have left?"
    steps = [f"{p}/{q} of {n} is {n} / {q} × {p} = {gone}.",
             f"{pr.capitalize()} has {n} − {gone} = {n - gone} left."]
    return q_text, steps, n - gone


def c_fraction_recipe(rng):
    num, den = rng.choice([(1, 2), (3, 4), (2, 3), (1, 3), (1, 4), (3, 2)])
    batches = den * rng.randint(2, 8)
    ing = rng.choice(["sugar", "flour", "milk", "oats", "rice"])
    total = num * batches // den
    q_text = f"A recipe uses {num}/{den} cup of {ing} per batch. How many cups of {ing} are needed for {batches} batches?"
    steps = [f"Multiply: {batches} × {num}/{den} = {batches * num}/{den}.",
             f"{batches * num} / {den} = {total} cups."]
    return q_text, steps, total


def c_fraction_budget(rng):
    name, pr, _ = person(rng)
    m = 12 * rng.randint(3, 25)
    q_text = (f"{name} has {money(m)}. {pr.capitalize()} spends 1/3 of it on books and 1/4 of it on lunch. "
              f"How many dollars are left?")
    a, b = m // 3, m // 4
    steps = [f"Books cost {m} / 3 = {a} dollars and lunch costs {m} / 4 = {b} dollars.",
             f"Spent: {a} + {b} = {a + b}. Left: {m} − {a + b} = {m - a - b} dollars."]
    return q_text, steps, m - a - b


def c_eq_linear(rng):
    a, x = rng.randint(2, 12), rng.randint(-10, 20)
    b = rng.choice([v for v in range(-20, 31) if v != 0])
    c = a * x + b
    sign = "+" if b >= 0 else "−"
    q_text = f"Solve for x: {a}x {sign} {abs(b)} = {c}."
    if b >= 0:
        s1 = f"Subtract {b} from both sides: {a}x = {c} − {b} = {c - b}."
    else:
        s1 = f"Add {abs(b)} to both sides: {a}x = {c} + {abs(b)} = {c - b}."
    steps = [s1, f"Divide both sides by {a}: x = {c - b} / {a} = {x}."]
    return q_text, steps, x


def c_eq_bracket(rng):
    a, x, b = rng.randint(2, 9), rng.randint(1, 25), rng.randint(1, 12)
    c = a * (x - b)
    q_text = f"Solve for x: {a}(x − {b}) = {c}."
    steps = [f"Divide both sides by {a}: x − {b} = {c} / {a} = {x - b}.",
             f"Add {b} to both sides: x = {x - b} + {b} = {x}."]
    return q_text, steps, x


def c_think_number(rng):
    name, pr, _ = person(rng)
    x, a, b = rng.randint(2, 30), rng.randint(2, 9), rng.randint(1, 20)
    c = a * x - b
    q_text = (f"{name} thinks of a number, multiplies it by {a}, then subtracts {b}. "
              f"The result is {c}. What number did {pr} think of?")
    steps = [f"Undo the subtraction: {c} + {b} = {c + b}.",
             f"Undo the multiplication: {c + b} / {a} = {x}."]
    return q_text, steps, x


def c_consecutive(rng):
    n = rng.randint(5, 200)
    s = 2 * n + 1
    q_text = f"The sum of two consecutive whole numbers is {s}. What is the larger number?"
    steps = [f"Call the numbers n and n + 1, so 2n + 1 = {s}.",
             f"2n = {s - 1}, so n = {n}, and the larger number is {n + 1}."]
    return q_text, steps, n + 1


def c_eq_divide(rng):
    a, y, b = rng.randint(2, 9), rng.randint(1, 15), rng.randint(1, 20)
    x = a * y
    c = y + b
    q_text = f"Solve for x: x/{a} + {b} = {c}."
    steps = [f"Subtract {b}: x/{a} = {c} − {b} = {y}.",
             f"Multiply by {a}: x = {y} × {a} = {x}."]
    return q_text, steps, x


def c_orchard(rng):
    r, c, k = rng.randint(3, 15), rng.randint(4, 20), rng.randint(10, 60)
    fruit = rng.choice(["apple", "pear", "plum", "orange", "peach"])
    q_text = (f"An orchard has {r} rows of {fruit} trees with {c} trees in each row. "
              f"Each tree gives {k} {fruit}s. How many {fruit}s does the orchard produce?")
    trees = r * c
    steps = [f"There are {r} × {c} = {trees} trees.",
             f"They produce {trees} × {k} = {trees * k} {fruit}s."]
    return q_text, steps, trees * k


def c_buses(rng):
    cap = rng.choice([30, 35, 40, 45, 48, 50, 52])
    n = rng.randint(60, 400)
    buses = math.ceil(n / cap)
    q_text = f"{n} students are going on a field trip. Each bus holds {cap} students. How many buses are needed?"
    if n % cap:
        steps = [f"{n} / {cap} = {n // cap} with a remainder of {n % cap}.",
                 f"The remaining {n % cap} students need one more bus, so {n // cap} + 1 = {buses} buses."]
    else:
        steps = [f"{n} / {cap} = {buses}, with nobody left over, so {buses} buses are enough."]
    return q_text, steps, buses


def c_average(rng):
    name, pr, _ = person(rng)
    k = rng.choice([3, 4, 5])
    while True:
        scores = [rng.randint(60, 100) for _ in range(k)]
        if sum(scores) % k == 0:
            break
    sc = ", ".join(str(s) for s in scores[:-1]) + f" and {scores[-1]}"
    q_text = f"{name} scored {sc} on {k} tests. What is {name}'s average score?"
    steps = [f"The total is {' + '.join(str(s) for s in scores)} = {sum(scores)}.",
             f"The average is {sum(scores)} / {k} = {sum(scores) // k}."]
    return q_text, steps, sum(scores) // k


def c_minutes(rng):
    h, m = rng.randint(1, 9), rng.randint(1, 59)
    task = rng.choice(["A hike", "A road trip", "A movie marathon", "A study session", "A flight"])
    q_text = f"{task} lasts {h} hours and {m} minutes. How many minutes is that in total?"
    steps = [f"{h} hours is {h} × 60 = {h * 60} minutes.",
             f"Adding {m} minutes gives {h * 60} + {m} = {h * 60 + m} minutes."]
    return q_text, steps, h * 60 + m


def c_savings_weeks(rng):
    name, pr, hi = person(rng)
    goal_item = rng.choice(["bike", "guitar", "tablet", "skateboard", "telescope"])
    w = rng.randint(5, 25)
    have = rng.randint(0, 10) * 5
    weeks = rng.randint(3, 20)
    price = have + w * weeks
    q_text = (f"{name} wants a {goal_item} that costs {money(price)}. {pr.capitalize()} has saved {money(have)} "
              f"and saves {money(w)} more each week. How many weeks until {pr} can buy it?")
    steps = [f"{pr.capitalize()} still needs {price} − {have} = {price - have} dollars.",
             f"At {w} dollars a week: {price - have} / {w} = {weeks} weeks."]
    return q_text, steps, weeks


CORPUS_TEMPLATES = [
    c_shop_total, c_shop_change, c_shop_discount, c_unit_price, c_speed_distance,
    c_time_from_distance, c_printer, c_tank, c_wages, c_rect_area, c_fence_cost,
    c_tile_boxes, c_triangle_area, c_box_volume, c_percent_of_group, c_percent_increase,
    c_test_percent, c_age_times, c_age_sum, c_age_past, c_fraction_give, c_fraction_recipe,
    c_fraction_budget, c_eq_linear, c_eq_bracket, c_think_number, c_consecutive,
    c_eq_divide, c_orchard, c_buses, c_average, c_minutes, c_savings_weeks,
]


# --------------------------------------------------------------------------
# Held-out templates (seed 2): same skills, different question types and wording.
# --------------------------------------------------------------------------

def e_market(rng):
    name, pr, _ = person(rng)
    a, b = rng.randint(2, 6), rng.randint(2, 6)
    p, q = rng.randint(2, 5), rng.randint(3, 7)
    q_text = (f"At the market {name} picks up {a} kg of apples priced at {money(p)} per kg and "
              f"{b} kg of pears priced at {money(q)} per kg. What does {pr} pay altogether?")
    steps = [f"Apples: {a} kg at {p} dollars per kg come to {a * p} dollars.",
             f"Pears: {b} kg at {q} dollars per kg come to {b * q} dollars.",
             f"Together: {a * p} plus {b * q} makes {a * p + b * q} dollars."]
    return q_text, steps, a * p + b * q


def e_bulk_deal(rng):
    item = rng.choice(["mug", "scarf", "water bottle", "notebook set", "plant pot"])
    p = rng.randint(8, 30)
    d = rng.randint(1, p // 3)
    n = rng.randint(3, 8)
    q_text = (f"A shop sells a {item} for {money(p)}. During a promotion each {item} is {money(d)} cheaper "
              f"if you buy at least 3. What do {n} of them cost during the promotion?")
    steps = [f"With the promotion one {item} is priced at {p} minus {d}, or {p - d} dollars.",
             f"Buying {n} at that price: {n} times {p - d} equals {n * (p - d)} dollars."]
    return q_text, steps, n * (p - d)


def e_fuel(rng):
    f = rng.randint(5, 14)
    k = rng.randint(2, 9)
    d = k * 100
    q_text = (f"A delivery van burns {f} liters of fuel for every 100 km driven. "
              f"How many liters does a {d} km route need?")
    steps = [f"The route is {d} km, which is {k} blocks of 100 km.",
             f"Fuel needed: {k} blocks times {f} liters per block gives {k * f} liters."]
    return q_text, steps, k * f


def e_opposite_runners(rng):
    (a, _, _), (b, _, _) = two_people(rng)
    sa, sb, h = rng.randint(6, 14), rng.randint(6, 14), rng.randint(2, 4)
    q_text = (f"{a} and {b} leave the same spot at the same moment, walking in opposite directions "
              f"at {sa} km/h and {sb} km/h. How far apart are they after {h} hours?")
    steps = [f"Moving apart, the gap between them grows by {sa} plus {sb}, or {sa + sb} km each hour.",
             f"After {h} hours the gap is {sa + sb} multiplied by {h}, which is {(sa + sb) * h} km."]
    return q_text, steps, (sa + sb) * h


def e_patio_rug(rng):
    s = rng.randint(5, 12)
    l, w = rng.randint(2, s - 1), rng.randint(1, s - 2)
    q_text = (f"A square patio has sides of {s} m. A rectangular rug measuring {l} m by {w} m is laid on it. "
              f"How many square meters of the patio stay uncovered?")
    steps = [f"Patio area: {s} squared is {s * s} square meters.",
             f"Rug area: {l} times {w} is {l * w} square meters.",
             f"Uncovered part: {s * s} take away {l * w} leaves {s * s - l * w} square meters."]
    return q_text, steps, s * s - l * w


def e_simple_interest(rng):
    P = rng.randint(5, 50) * 100
    r = rng.randint(2, 6)
    t = rng.randint(2, 5)
    i = P * r * t // 100
    q_text = (f"A savings account pays {r}% simple interest each year. If {money(P)} is deposited, "
              f"how much interest has it earned after {t} years?")
    steps = [f"Interest for one year is {r}/100 of {P}, which is {P * r // 100} dollars.",
             f"Simple interest does not compound, so over {t} years it is {t} lots of {P * r // 100}, "
             f"giving {i} dollars."]
    return q_text, steps, i


def e_concert_shirts(rng):
    n = rng.randint(4, 40) * 20
    p = rng.choice([5, 10, 15, 20, 25, 30])
    c = rng.randint(12, 30)
    k = n * p // 100
    q_text = (f"{n} people came to a concert and {p}% of them bought a T-shirt for {money(c)}. "
              f"How much money did the T-shirt stand take in?")
    steps = [f"Buyers: {p} out of every 100 of the {n} fans, that is {k} people.",
             f"Takings: {k} shirts sold at {c} dollars bring in {k * c} dollars."]
    return q_text, steps, k * c


def e_twice_as_old(rng):
    d = rng.randint(4, 15)
    m = 2 * d + rng.randint(2, 15)
    y = m - 2 * d
    q_text = (f"A mother is {m} years old and her daughter is {d}. "
              f"In how many years will the mother be exactly twice her daughter's age?")
    steps = [f"After y years the mother is {m} + y and the daughter is {d} + y.",
             f"Set {m} + y = 2({d} + y), which means {m} + y = {2 * d} + 2y.",
             f"Rearranging gives y = {m} − {2 * d} = {y}.",
             f"Check: in {y} years they are {m + y} and {d + y}, and {m + y} is double {d + y}."]
    return q_text, steps, y


def e_tank_fraction(rng):
    b = rng.choice([3, 4, 5, 8])
    a = rng.choice([k for k in range(1, b) if math.gcd(k, b) == 1])
    c = b * rng.randint(20, 200)
    inside = c * a // b
    x = rng.randint(1, inside - 1)
    q_text = (f"A water barrel holds {c} liters when full and is currently {a}/{b} full. "
              f"Then {x} liters are drawn off for the garden. How many liters are still in the barrel?")
    steps = [f"Water in the barrel at first: {c} divided by {b}, times {a}, equals {inside} liters.",
             f"After drawing off {x} liters there are {inside} minus {x}, that is {inside - x} liters."]
    return q_text, steps, inside - x


def e_rect_perimeter_eq(rng):
    w, k = rng.randint(2, 30), rng.randint(1, 15)
    L = w + k
    P = 2 * (L + w)
    q_text = (f"A rectangle's perimeter is {P} cm, and its length is {k} cm greater than its width. "
              f"Find the width in centimeters.")
    steps = [f"Write the width as w, so the length is w + {k}.",
             f"Perimeter: 2(w + w + {k}) = {P}, so 4w + {2 * k} = {P}.",
             f"Then 4w = {P - 2 * k}, and w = {w}."]
    return q_text, steps, w


def e_mystery_number(rng):
    a, b = rng.sample(range(2, 8), 2)
    x = rng.randint(2, 40)
    n = (a + b) * x
    q_text = (f"Adding {a} times a mystery number to {b} times the same number gives {n}. "
              f"What is the mystery number?")
    steps = [f"Together that is ({a} + {b}) = {a + b} copies of the number.",
             f"Dividing {n} by {a + b} reveals the number: {x}."]
    return q_text, steps, x


def e_library(rng):
    a, b, c = rng.randint(3, 12), rng.randint(10, 40), rng.randint(100, 900)
    d = rng.randint(20, 150)
    q_text = (f"A library owns {c} books, then receives {a} boxes holding {b} books apiece. "
              f"If {d} books are checked out, how many remain on its shelves?")
    steps = [f"The delivery adds {a} lots of {b}, or {a * b} books, raising the stock to {c + a * b}.",
             f"With {d} on loan, the shelves hold {c + a * b} minus {d}, which is {c + a * b - d} books."]
    return q_text, steps, c + a * b - d


def e_bakery(rng):
    a, h = rng.randint(6, 30), rng.randint(3, 9)
    made = a * h
    s = rng.randint(made // 3, made - 1)
    q_text = (f"A bakery oven turns out {a} loaves every hour and runs for {h} hours. "
              f"By closing time {s} loaves have been sold. How many loaves are unsold?")
    steps = [f"Loaves baked over the day: {a} per hour for {h} hours is {made}.",
             f"Unsold loaves: {made} less the {s} sold leaves {made - s}."]
    return q_text, steps, made - s


def e_average_speed(rng):
    while True:
        d = [rng.randint(40, 110) for _ in range(3)]
        if sum(d) % 3 == 0:
            break
    q_text = (f"On a trip a car covers {d[0]} km in the first hour, {d[1]} km in the second hour and "
              f"{d[2]} km in the third hour. What was its average speed in km/h?")
    steps = [f"Total distance over the three hours: {d[0]} + {d[1]} + {d[2]} = {sum(d)} km.",
             f"Average speed is total distance over total time: {sum(d)} km in 3 h gives {sum(d) // 3} km/h."]
    return q_text, steps, sum(d) // 3


def e_split_bill(rng):
    n = rng.randint(3, 8)
    each = rng.randint(12, 45)
    tip = rng.randint(1, 6) * n
    bill = n * each - tip
    q_text = (f"{n} friends share a restaurant bill of {money(bill)} and add a {money(tip)} tip. "
              f"They split the total evenly. How much does each friend pay?")
    steps = [f"Bill plus tip: {bill} and {tip} make {bill + tip} dollars.",
             f"Shared by {n} friends, each pays {bill + tip} divided by {n}, or {each} dollars."]
    return q_text, steps, each


def e_paint_walls(rng):
    walls = rng.randint(2, 4)
    l, h = rng.randint(3, 8), rng.choice([2, 3])
    cov = rng.choice([5, 6, 8, 10])
    area = walls * l * h
    cans = math.ceil(area / cov)
    q_text = (f"Someone is painting {walls} walls, each {l} m wide and {h} m high. One can of paint covers "
              f"{cov} square meters. How many cans must they buy?")
    steps = [f"One wall is {l} by {h}, so {l * h} square meters; {walls} walls make {area} square meters.",
             (f"{area} over {cov} is not a whole number, so an extra can is needed: {cans} cans."
              if area % cov else f"{area} over {cov} is exactly {cans} cans.")]
    return q_text, steps, cans


EVAL_TEMPLATES = [
    e_market, e_bulk_deal, e_fuel, e_opposite_runners, e_patio_rug, e_simple_interest,
    e_concert_shirts, e_twice_as_old, e_tank_fraction, e_rect_perimeter_eq, e_mystery_number,
    e_library, e_bakery, e_average_speed, e_split_bill, e_paint_walls,
]


# --------------------------------------------------------------------------

WORD = re.compile(r"[a-z0-9]+")


def shingles(text: str, k: int = 8) -> set[tuple[str, ...]]:
    toks = WORD.findall(text.lower())
    return {tuple(toks[i:i + k]) for i in range(len(toks) - k + 1)}


def make_item(fn, rng) -> dict:
    q, steps, ans = fn(rng)
    assert isinstance(ans, int), (fn.__name__, ans)
    return {"question": q, "answer": "\n".join(steps + [f"The answer is {ans}."])}


def generate(templates, n, seed, banned_questions=frozenset(), banned_shingles=frozenset()):
    rng = random.Random(seed)
    items, seen = [], set()
    attempts = 0
    while len(items) < n:
        attempts += 1
        if attempts > 200 * n:
            raise RuntimeError("could not generate enough unique items")
        fn = templates[len(items) % len(templates)]
        item = make_item(fn, rng)
        key = item["question"]
        if key in seen or key in banned_questions:
            continue
        if banned_shingles and shingles(item["question"] + " " + item["answer"]) & banned_shingles:
            continue
        seen.add(key)
        items.append(item)
    return items


def write_jsonl(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus-n", type=int, default=220)
    ap.add_argument("--eval-n", type=int, default=340)
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args()

    corpus = generate(CORPUS_TEMPLATES, args.corpus_n, seed=1)
    corpus_q = frozenset(r["question"] for r in corpus)
    corpus_sh = frozenset().union(*(shingles(r["question"] + " " + r["answer"]) for r in corpus))
    held = generate(EVAL_TEMPLATES, args.eval_n, seed=2,
                    banned_questions=corpus_q, banned_shingles=corpus_sh)

    # Checks: no duplicates within or across files, no shared 8-word shingle.
    eval_q = [r["question"] for r in held]
    assert len(set(corpus_q)) == len(corpus), "duplicate question inside corpus"
    assert len(set(eval_q)) == len(held), "duplicate question inside eval"
    assert not corpus_q & set(eval_q), "eval question also in corpus"
    for r in held:
        assert not shingles(r["question"] + " " + r["answer"]) & corpus_sh, r["question"]
    for r in corpus + held:
        assert re.search(r"The answer is -?\d+\.$", r["answer"]), r

    write_jsonl(args.out / "corpora" / "math.jsonl", corpus)
    write_jsonl(args.out / "eval" / "math.jsonl", held)
    print(f"wrote {len(corpus)} corpus items and {len(held)} eval items; "
          f"0 shared questions, 0 shared 8-word shingles")


if __name__ == "__main__":
    main()
