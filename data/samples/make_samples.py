"""Write the sample inputs in this directory. Deterministic: running it again gives the same files.

    python data/samples/make_samples.py

labeling.parquet   40 product reviews to label; every prompt shares one long instruction (prefix-cache friendly)
prompts.parquet    30 generation prompts of varied lengths, with a per-row max_tokens for a few rows
bad_rows.parquet   12 rows, some of them unusable (null, empty, too long, invalid per-row values)
tickets.parquet    120 support tickets for a 9-label `choice` job (jobs/ticket_labels.yaml), each with the team
                   that wrote the template it came from (`expected`: not given to the model)
"""
from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent

PRODUCTS = ["wireless earbuds", "standing desk", "espresso machine", "trail running shoes", "robot vacuum",
            "mechanical keyboard", "air fryer", "e-reader", "camping tent", "electric toothbrush"]
OPENINGS = {
    "positive": ["Honestly impressed.", "Exceeded my expectations.", "Best purchase this year.", "Really happy with it."],
    "negative": ["Very disappointed.", "Would not buy again.", "Returned it after a week.", "Not worth the money."],
    "neutral": ["It is fine.", "Does what it says.", "Mixed feelings overall.", "About what I expected."],
}
DETAILS = {
    "positive": ["Setup took five minutes and it has worked flawlessly since.", "The build quality feels premium.",
                 "Battery life is even better than advertised.", "Customer support answered within an hour."],
    "negative": ["It stopped working after two weeks.", "The instructions were missing half the steps.",
                 "It is much louder than the description suggests.", "Support never replied to my emails."],
    "neutral": ["Shipping was on time.", "The color is slightly different from the photos.",
                "It works, but the app is clunky.", "Price is average for this category."],
}


def labeling(rng: random.Random) -> pa.Table:
    rows = {"review_id": [], "product": [], "review": []}
    for i in range(40):
        mood = ["positive", "negative", "neutral"][i % 3]
        product = PRODUCTS[rng.randrange(len(PRODUCTS))]
        sentences = [rng.choice(OPENINGS[mood])] + rng.sample(DETAILS[mood], k=rng.randint(1, 3))
        rows["review_id"].append(f"R-{1001 + i}")
        rows["product"].append(product)
        rows["review"].append(" ".join(sentences))
    return pa.table(rows)


SHORT = [
    ("trivia", "Name three primary colors."),
    ("trivia", "What is the capital of Australia?"),
    ("math", "What is 17 times 23? Show the steps."),
    ("writing", "Write a haiku about autumn rain."),
    ("writing", "Suggest a name for a bakery that only sells bread."),
    ("cooking", "How long should I boil an egg for a runny yolk?"),
    ("science", "Why is the sky blue? Answer in two sentences."),
    ("coding", "Write a Python function that reverses a string."),
    ("coding", "What does the SQL keyword DISTINCT do?"),
    ("travel", "Give me three tips for a long flight."),
]
PASSAGE = ("The city council met on Tuesday to discuss the new bike lane proposal. Supporters argued that protected "
           "lanes reduce accidents and encourage people to leave their cars at home. Shop owners on Main Street "
           "worried that removing parking spaces would hurt their business, especially during the holiday season. "
           "After three hours of debate, the council agreed to a six-month pilot on two streets, with a review of "
           "traffic and sales figures at the end. ")


def prompts(rng: random.Random) -> pa.Table:
    rows = {"id": [], "topic": [], "prompt": [], "max_tokens": []}
    for i in range(30):
        if i % 3 == 2:  # a longer prompt: a passage (repeated 1-3 times) to work on
            topic = "summarizing"
            task = ["Summarize this in one sentence:", "List the main arguments in this text:",
                    "Write a headline for this news story:"][i % 9 // 3]
            text = f"{task}\n\n{PASSAGE * rng.randint(1, 3)}".strip()
        else:
            topic, text = SHORT[(i * 7) % len(SHORT)]
            if i >= len(SHORT):
                text = f"{text} Keep it brief."
        rows["id"].append(i + 1)
        rows["topic"].append(topic)
        rows["prompt"].append(text)
        rows["max_tokens"].append(16 if i % 10 == 4 else None)  # a per-row override for a few rows
    return pa.table(rows, schema=pa.schema([("id", pa.int64()), ("topic", pa.string()), ("prompt", pa.string()),
                                            ("max_tokens", pa.int64())]))


def bad_rows() -> pa.Table:
    too_long = "This sentence repeats to make a prompt longer than the model's context window. " * 800
    rows = [
        ("ok-1", "Say hello in French.", None, None),
        ("null-prompt", None, None, None),
        ("empty-prompt", "", None, None),
        ("blank-prompt", "   \n ", None, None),
        ("ok-2", "Count from one to five.", None, None),
        ("too-long", too_long, None, None),
        ("bad-temperature", "Tell me a joke.", -0.5, None),
        ("bad-max-tokens", "Tell me a fact about owls.", None, 0),
        ("ok-3", "What is the opposite of cold?", 0.0, 8),
        ("nan-temperature", "Name a fruit.", float("nan"), None),  # NaN = not set: the job's value
        ("ok-4", "Translate 'thank you' into Spanish.", None, None),
        ("bad-max-tokens-2", "Describe the moon.", None, -3),
    ]
    ids, prompts_, temps, maxes = map(list, zip(*rows))
    return pa.table({"id": ids, "prompt": pa.array(prompts_, pa.string()),
                     "temperature": pa.array(temps, pa.float64()), "max_tokens": pa.array(maxes, pa.int64())})


TICKET_TEAMS = {
    "BILLING": ["I was charged twice for order {order}.", "The invoice for order {order} shows the wrong amount.",
                "Why was my card charged before the {item} shipped?", "I need a copy of the receipt for my {item}."],
    "SHIPPING": ["My {item} has been in transit for {days} days.", "The tracking page for order {order} has not "
                 "moved since last week.", "The courier left my {item} at the wrong address.",
                 "Can I change the delivery address for order {order}?"],
    "RETURNS": ["How do I send back the {item}? It does not fit.", "I want a refund for the broken {item}.",
                "The return label for order {order} does not print.", "Can I exchange the {item} for another "
                "color?"],
    "ACCOUNT": ["I cannot log in: the password reset email never arrives.", "Please change the email address "
                "on my account.", "My account was locked after {days} failed logins.",
                "How do I merge my two accounts?"],
    "TECHNICAL": ["The app crashes every time I open the {item} page.", "The website shows error {order} at "
                  "checkout.", "The {item} will not pair with my phone over Bluetooth.",
                  "The firmware update bricked my {item}."],
    "PRODUCT": ["Does the {item} come in a larger size?", "Is the {item} dishwasher safe?",
                "What is the battery life of the {item}?", "Is the {item} compatible with the older model?"],
    "PRIVACY": ["Please delete all the personal data you hold about me.", "Why do you share my address with "
                "third parties?", "I want a copy of every piece of data you store about me.",
                "Stop sending my details to advertisers."],
    "FEEDBACK": ["Your support agent was wonderful, thank you!", "I love the {item}, best purchase this year.",
                 "The new website design is much harder to use.", "Please bring back the old {item} model."],
    "OTHER": ["What are your opening hours on public holidays?", "Are you hiring in the warehouse?",
              "Do you have a store in my city?", "Who designed your logo?"],
}
TICKET_ITEMS = ["blender", "desk lamp", "rain jacket", "headphones", "coffee grinder", "backpack", "smartwatch",
                "air fryer", "yoga mat", "baby monitor"]
TICKET_OPENERS = ["", "Hello, ", "Hi team, ", "Urgent: ", "Good morning. ", "Quick question: "]


def tickets(rng: random.Random) -> pa.Table:
    rows = {"ticket_id": [], "channel": [], "ticket": [], "expected": []}
    teams = list(TICKET_TEAMS)
    for i in range(120):
        team = teams[i % len(teams)]
        text = rng.choice(TICKET_TEAMS[team]).format(order=rng.randint(10000, 99999), item=rng.choice(TICKET_ITEMS),
                                                     days=rng.randint(3, 21))
        rows["ticket_id"].append(f"T-{5001 + i}")
        rows["channel"].append(rng.choice(["email", "chat", "phone"]))
        rows["ticket"].append(rng.choice(TICKET_OPENERS) + text)
        rows["expected"].append(team)
    return pa.table(rows)


def main() -> None:
    pq.write_table(labeling(random.Random(1)), HERE / "labeling.parquet")
    pq.write_table(prompts(random.Random(2)), HERE / "prompts.parquet")
    pq.write_table(bad_rows(), HERE / "bad_rows.parquet")
    pq.write_table(tickets(random.Random(3)), HERE / "tickets.parquet")


if __name__ == "__main__":
    main()
