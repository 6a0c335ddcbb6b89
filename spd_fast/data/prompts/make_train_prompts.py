#!/usr/bin/env python3
"""Generate the spd_fast draft-head training prompt set (train.jsonl).

All topic lists, templates, code snippets and paragraphs below were written
for the spd_fast project; nothing is copied from a public dataset.  The
prompts are fed to the target chat model (SmolLM2-135M-Instruct) to
self-distil training data for the draft head.  The held-out evaluation sets
(eval_chat.jsonl, eval_math.jsonl, eval_code.jsonl) are hand-written
separately and are NOT produced by this script.

The output is fully deterministic: a single ``random.Random(0)`` drives every
choice, and pools are built only by iterating lists and insertion-ordered
dicts (never sets), so the result does not depend on PYTHONHASHSEED.

Usage (from the repository root or anywhere)::

    python spd_fast/data/prompts/make_train_prompts.py            # writes train.jsonl next to this file
    python spd_fast/data/prompts/make_train_prompts.py --out x.jsonl

Each output line is ``{"id": "train-00000", "category": "...", "prompt": "..."}``.
Standard library only.
"""

import argparse
import json
import os
import random

SEED = 0
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "train.jsonl")

# Number of prompts taken from each category (sums to 3000).
QUOTAS = [
    ("chat", 200),
    ("explain", 300),
    ("howto", 230),
    ("advice", 200),
    ("math", 320),
    ("reasoning", 100),
    ("code", 480),
    ("summarize", 140),
    ("list", 220),
    ("creative", 220),
    ("compare", 130),
    ("define", 130),
    ("rewrite", 110),
    ("rephrase", 90),
    ("email", 130),
]


def cap(s):
    return s[:1].upper() + s[1:]


def low(s):
    return s[:1].lower() + s[1:]


def bare(term):
    """Drop a leading article: 'an ecosystem' -> 'ecosystem'."""
    for art in ("a ", "an "):
        if term.startswith(art):
            return term[len(art):]
    return term


def cross(templates, items, fmt):
    """One group per template: [fmt(template, item) for item in items]."""
    return [[fmt(t, x) for x in items] for t in templates]


# ---------------------------------------------------------------------------
# Shared vocabulary
# ---------------------------------------------------------------------------

NAMES = [
    "Maya", "Liam", "Sofia", "Noah", "Aisha", "Ethan", "Priya", "Lucas", "Chen",
    "Olivia", "Mateo", "Zara", "Omar", "Hannah", "Kenji", "Grace", "Diego",
    "Amara", "Felix", "Nina", "Samuel", "Leila", "Jonah", "Rosa", "Tariq",
    "Emma", "Ravi", "Clara", "Yusuf", "Ivy", "Marco", "Freya", "Anton", "Lina",
]

COUNT_ITEMS = [
    "apples", "marbles", "stickers", "pencils", "cookies", "books", "stamps",
    "seashells", "baseball cards", "cupcakes", "balloons", "oranges",
    "toy cars", "beads", "postcards", "crayons", "eggs", "muffins", "plums",
    "notebooks", "shells", "buttons", "coins", "flowers",
]

SHOP_ITEMS = [
    ("notebooks", 3), ("sandwiches", 6), ("pens", 2), ("bus tickets", 3),
    ("mugs", 8), ("T-shirts", 12), ("candles", 5), ("plant pots", 7),
    ("comic books", 4), ("bags of rice", 9), ("movie tickets", 11),
    ("jars of honey", 6), ("packs of cards", 5), ("loaves of bread", 4),
]

CLOTHES = [
    "jacket", "pair of shoes", "sweater", "backpack", "dress", "pair of jeans",
    "winter coat", "hat", "scarf", "lamp", "bicycle helmet", "desk chair",
    "watch", "rain jacket", "pair of headphones",
]

# ---------------------------------------------------------------------------
# chat
# ---------------------------------------------------------------------------

GREETINGS = [
    "Hi there!", "Hello!", "Hey!", "Good morning!", "Good evening!",
    "Hi, hope you're doing well.", "Hey, it's me again.",
]

CHAT_LINES = [
    "How is your day going?", "What do you like to talk about?",
    "Can you tell me something interesting?", "I'm bored. Can you cheer me up?",
    "Tell me a fun fact.", "What's a good way to start a Monday?",
    "Do you have any favorite books?", "What should I cook for dinner tonight?",
    "Can you recommend a kind of movie for a rainy night?",
    "What makes a good friend?", "What would you do with a free afternoon?",
    "Is it better to be a morning person or a night owl?",
    "Give me a random conversation starter.",
    "What's something that always makes people smile?",
    "Say something nice to brighten my day.", "Tell me a riddle.",
    "What's the best thing about weekends?",
    "What's a small habit that can improve a day?",
    "Which season do you think is the most beautiful?",
    "Say good morning to me in a cheerful way.",
    "Can you give me a word of the day?", "Ask me a fun question.",
    "What's a good song to hum while doing chores?",
    "Do you think it's going to be a good week?",
    "Tell me something that happened in history on a random day.",
    "What's a simple thing I can do to feel more relaxed?",
    "Let's play twenty questions. You think of something first.",
    "What would be a fun name for a pet turtle?",
    "Can you tell me a short motivational quote you made up?",
    "What is a good snack for a movie night?",
    "Can you pretend to be a friendly tour guide for a minute?",
    "Give me a tongue twister to try.",
    "What's an easy board game for two people?",
    "I can't decide what to do today. Pick something for me.",
    "What do you think makes a day memorable?",
]

ANIMALS = [
    "octopuses", "penguins", "elephants", "owls", "dolphins", "giraffes",
    "bats", "sloths", "honeybees", "kangaroos", "hummingbirds", "sharks",
    "tortoises", "crows", "cats", "dogs", "horses", "frogs", "butterflies",
    "wolves", "koalas", "camels", "seahorses", "ants", "parrots",
    "polar bears", "snails", "jellyfish", "flamingos", "hedgehogs", "otters",
    "chameleons", "squirrels", "whales", "spiders", "rabbits", "foxes",
    "pandas", "lions", "peacocks",
]

MOODS = [
    "tired", "a bit sad", "really happy", "stressed", "bored", "nervous",
    "grumpy", "excited", "lonely", "restless", "unmotivated",
    "proud of myself",
]
MOOD_REQUESTS = [
    "Can you chat with me for a bit?", "What do you suggest I do this evening?",
    "Tell me something interesting.", "Any ideas for how to spend the afternoon?",
    "Can you recommend one small thing to do right now?",
]

HOBBIES = [
    "painting", "gardening", "chess", "hiking", "knitting", "photography",
    "baking", "birdwatching", "rock climbing", "playing guitar",
    "writing poetry", "woodworking", "yoga", "fishing", "pottery", "cycling",
    "swimming", "learning magic tricks", "collecting stamps", "astronomy",
    "board games", "dancing", "calligraphy", "running", "origami",
    "video games", "cooking Thai food", "sewing", "skateboarding",
    "journaling", "singing in a choir", "camping", "jigsaw puzzles",
    "sketching", "playing the piano",
]
HOBBY_T = [
    "Do you think {} is a good hobby for a beginner?",
    "I've just started {}. Any words of encouragement?",
    "What do people enjoy most about {}?",
    "Let's talk about {}. What makes it fun?",
]

JOKE_SUBJECTS = [
    "computers", "cats", "vegetables", "the weather", "math", "coffee",
    "penguins", "libraries", "pirates", "socks", "the moon", "bakers",
    "dinosaurs", "trains", "bananas", "robots", "homework", "clouds",
    "snails", "musicians", "spiders", "pizza", "the ocean", "time travel",
    "cheese", "astronauts", "chickens", "Mondays", "phones", "books",
]
JOKE_T = [
    "Tell me a joke about {}.", "Do you know a funny pun about {}?",
    "Make me laugh with a short joke about {}.",
]

PLACES = [
    "Paris", "Tokyo", "the Sahara Desert", "Antarctica", "the Amazon rainforest",
    "Iceland", "New York City", "a small Greek island", "the Swiss Alps",
    "Cairo", "Rio de Janeiro", "Kyoto", "the Great Barrier Reef", "Istanbul",
    "a medieval castle", "the bottom of the ocean", "the Moon", "Mars",
    "a tropical beach", "Venice", "Marrakech", "the Scottish Highlands",
    "Hong Kong", "Buenos Aires", "a lighthouse on a rocky coast", "Nairobi",
    "the Grand Canyon", "Vancouver", "Mexico City", "Seoul",
    "a treehouse in the forest", "Lisbon", "the fjords of Norway", "Bali",
    "Mumbai", "Sydney", "Cape Town", "Prague", "a space station",
    "a quiet farm in the countryside",
]
PLACE_T = [
    "If you could spend a day in {}, what would you do?",
    "What would a perfect weekend in {} look like?",
    "I'm daydreaming about {}. Describe what it might feel like to be there.",
]

EVENTS = [
    "finished my first 5K run", "adopted a kitten", "got a new job",
    "baked bread for the first time", "passed my driving test",
    "moved into a new apartment", "finished reading a really long book",
    "learned to ride a bike", "planted my first garden",
    "got back from a long trip", "started learning Spanish",
    "cooked dinner for my whole family", "fixed my own bike",
    "made a new friend at work", "finished a 1000-piece puzzle",
    "won a board game tournament", "painted my bedroom",
    "ran into an old friend", "saw a shooting star",
    "got a good grade on a hard test", "cleaned out my garage",
    "wrote my first short story", "gave my first presentation",
    "spent the whole day outside", "tried sushi for the first time",
]
EVENT_REACTIONS = [
    "What do you think?", "Can you celebrate with me?",
    "What should I do next?", "Isn't that great?",
]

FAVORITES = [
    "season", "color", "kind of weather", "type of music", "holiday",
    "time of day", "dessert", "board game", "animal", "book genre",
    "kind of tree", "sport to watch", "planet", "number", "word in English",
    "breakfast food", "fruit", "way to relax", "type of movie", "flower",
]
FAVORITE_T = [
    "What's your favorite {} and why?",
    "If you had to pick one {}, which would it be?",
]


def build_chat(rng):
    groups = []
    groups.append([g + " " + c for g in GREETINGS for c in CHAT_LINES])
    groups += cross(
        ["Tell me a fun fact about {}.", "What's the most surprising thing about {}?",
         "Do you think {} would make good pets?"],
        ANIMALS, str.format)
    groups.append(["I'm feeling {} today. {}".format(m, r)
                   for m in MOODS for r in MOOD_REQUESTS])
    groups += cross(HOBBY_T, HOBBIES, str.format)
    groups += cross(JOKE_T, JOKE_SUBJECTS, str.format)
    groups += cross(PLACE_T, PLACES, str.format)
    groups += [["I just {}! {}".format(e, r) for e in EVENTS] for r in EVENT_REACTIONS]
    groups += cross(FAVORITE_T, FAVORITES, str.format)
    return groups


# ---------------------------------------------------------------------------
# explain
# ---------------------------------------------------------------------------

SCIENCE = [
    "photosynthesis", "gravity", "the water cycle", "plate tectonics",
    "natural selection", "the immune system", "DNA", "black holes",
    "the speed of light", "static electricity", "magnetism",
    "the greenhouse effect", "ocean tides", "rainbows", "volcanoes",
    "earthquakes", "the seasons on Earth", "the phases of the Moon",
    "sound waves", "friction", "buoyancy", "osmosis", "cell division",
    "vaccines", "antibiotics", "the periodic table", "chemical bonds",
    "acids and bases", "nuclear fission", "solar eclipses",
    "the Doppler effect", "inertia", "electric circuits", "thunderstorms",
    "fossils", "the carbon cycle", "metabolism", "the nervous system",
    "sleep cycles", "erosion", "condensation", "atoms", "entropy", "momentum",
    "the Big Bang theory", "galaxies", "comets", "the refraction of light",
    "hibernation", "pollination", "food chains", "coral reefs",
    "ocean currents", "hurricanes", "the ozone layer", "genetic mutations",
    "enzymes", "the human heart", "red blood cells", "lightning",
    "kinetic energy", "the solar system", "evaporation", "bacteria",
    "the human skeleton", "digestion",
]

TECH = [
    "the internet", "cloud computing", "machine learning", "encryption",
    "a computer's CPU", "computer memory (RAM)", "operating systems", "Wi-Fi",
    "Bluetooth", "blockchain", "compilers", "databases", "web APIs",
    "version control with Git", "search engines", "browser cookies",
    "password hashing", "solid-state drives", "touchscreens",
    "the Domain Name System", "virtual machines", "open-source software",
    "neural networks", "QR codes", "email delivery",
    "two-factor authentication", "3D printing", "electric cars",
    "solar panels", "lithium-ion batteries", "fiber-optic cables",
    "graphics cards", "caching", "data compression", "barcodes",
    "cryptocurrency", "HTTP", "spreadsheets", "GPS", "smart speakers",
    "screen resolution", "binary numbers", "algorithms", "computer viruses",
    "large language models",
]

EXPLAIN_T = [
    "Explain {} in simple terms.",
    "What is {}? Keep the answer short.",
    "Can you explain {} to a ten-year-old?",
    "Give me a quick overview of {}.",
    "Explain {} in three sentences.",
    "I never really understood {}. Could you break it down for me?",
    "What is the basic idea behind {}?",
    "Write a short paragraph explaining {}.",
    "Explain {} using an everyday analogy.",
    "What are the most important things to know about {}?",
]

HISTORY = [
    "the printing press", "the Roman Empire", "the Industrial Revolution",
    "the French Revolution", "the pyramids of ancient Egypt", "the Silk Road",
    "the Renaissance", "the fall of the Berlin Wall",
    "the invention of the telephone", "the Wright brothers' first flight",
    "the first Moon landing", "the Great Wall of China", "the Magna Carta",
    "the Black Death", "the age of exploration", "the ancient Olympic Games",
    "the invention of writing", "the Bronze Age", "the abolition of slavery",
    "the women's suffrage movement", "the Cold War", "the steam engine",
    "the Maya civilization", "the Library of Alexandria", "the Viking voyages",
    "the invention of paper", "the transcontinental railroad",
    "the Ottoman Empire", "the Meiji Restoration",
    "the invention of the light bulb", "the first vaccines", "the space race",
    "the California Gold Rush", "democracy in ancient Athens",
    "the building of the Panama Canal", "the Mongol Empire",
    "the invention of the compass", "the first electronic computers",
    "the Great Depression", "the Hanseatic League",
]
HISTORY_T = [
    "Tell me about {}.", "Why was {} important?", "Give a short history of {}.",
    "Explain {} in a few sentences.", "What should a student remember about {}?",
    "How did {} change the world?",
    "Describe {} for someone who knows nothing about history.",
]

EVERYDAY_Q = [
    "Why is the sky blue?", "How does a refrigerator keep food cold?",
    "Why does bread rise?", "How do credit scores work?", "Why do we yawn?",
    "How does a microwave heat food?", "Why do leaves change color in autumn?",
    "How does soap remove dirt?", "Why does ice float on water?",
    "How does a thermostat work?", "Why do onions make people cry?",
    "What happens to plastic after it goes into a recycling bin?",
    "How does compound interest work?", "Why does coffee keep people awake?",
    "How does a zipper work?", "Why do cats purr?", "What causes hiccups?",
    "How does a bicycle stay upright when it moves?", "Why does milk go sour?",
    "Why does metal feel colder than wood at the same temperature?",
    "How does sunscreen protect skin?", "Why does popcorn pop?",
    "How does a pressure cooker cook food faster?", "How do elevators work?",
    "Why do we dream?", "How does a smoke detector work?",
    "Why does salt melt ice on roads?", "Why do our fingers wrinkle in the bath?",
    "How do noise-cancelling headphones work?",
    "Why does the Moon look bigger near the horizon?",
    "Why do we get goosebumps?", "How do airplanes stay in the air?",
    "Why do stars twinkle?", "Why is the ocean salty?",
    "How do bees make honey?", "Why do we need to drink water?",
    "How does a candle burn?", "Why do apples turn brown after being cut?",
    "How does a compass point north?", "Why do some people need glasses?",
    "How does a washing machine clean clothes?", "Why do cut flowers wilt?",
    "Why does thunder come after lightning?",
    "How do plants know which way is up?",
    "Why do our ears pop on airplanes?", "Why does a kettle whistle?",
    "Why does a spoon look bent in a glass of water?",
    "Why do dogs wag their tails?", "Why do we have leap years?",
    "How do fireworks get their colors?",
]
EVERYDAY_T = [
    "{}", "Quick question: {}", "I've always wondered: {}",
    "{} Please keep the answer simple.", "{} Explain it like I'm five.",
]


def _everyday(t, q):
    if t.startswith("{}"):
        return t.format(q)
    return t.format(low(q))


def build_explain(rng):
    groups = []
    groups += cross(EXPLAIN_T, SCIENCE, str.format)
    groups += cross(EXPLAIN_T, TECH, str.format)
    groups += cross(HISTORY_T, HISTORY, str.format)
    groups += cross(EVERYDAY_T, EVERYDAY_Q, _everyday)
    return groups


# ---------------------------------------------------------------------------
# howto
# ---------------------------------------------------------------------------

HOWTO_TASKS = [
    "make a good cup of tea", "fix a flat bicycle tire",
    "grow tomatoes on a balcony", "make a monthly budget",
    "clean a cast iron pan", "tie a tie", "write a cover letter",
    "start learning a new language", "set up a home Wi-Fi network",
    "bake banana bread", "remove a coffee stain from a shirt",
    "prepare for a job interview", "organize a messy closet", "boil an egg",
    "start running as a beginner", "begin a daily meditation habit",
    "back up photos from a phone", "make a paper airplane",
    "fold a fitted sheet", "unclog a kitchen sink", "study for a math exam",
    "make a simple green salad", "take better photos with a phone",
    "keep a houseplant alive", "create a strong password",
    "pack for a weekend trip", "memorize a short speech",
    "fix a squeaky door hinge", "make pizza dough at home",
    "teach a dog to sit", "start a small vegetable garden",
    "cut down on screen time", "save money on groceries",
    "clean a laptop keyboard", "make cold brew coffee",
    "set up a freshwater aquarium", "write a clear email subject line",
    "check the oil in a car", "juggle three balls", "paint a room",
    "hang a picture frame straight", "make a fruit smoothie",
    "sharpen a kitchen knife", "cook rice on the stove", "write a resume",
    "plan a birthday party", "make a to-do list that actually works",
    "improve handwriting", "wash a wool sweater", "jump-start a car",
    "compost food scraps", "iron a dress shirt", "set up a new laptop",
    "make homemade lemonade", "start a podcast", "make friends in a new city",
    "get rid of fruit flies", "write a thank-you note",
    "build a campfire safely", "make fluffy scrambled eggs",
    "learn to touch type", "clean windows without streaks", "repot a plant",
    "build a simple bookshelf", "teach a child to ride a bike",
    "make a weekly meal plan", "improve posture at a desk",
    "brew loose-leaf green tea", "knit a simple scarf",
    "install a Python package", "take good notes in a lecture",
    "defrost a freezer", "plant a young tree", "wrap a gift neatly",
    "make a simple budget spreadsheet", "remove a splinter",
    "keep a cut flower bouquet fresh longer", "clean a bathroom quickly",
    "pick a ripe watermelon", "learn basic first aid",
]
HOWTO_T = [
    "How do I {}?", "What are the steps to {}?",
    "Give me step-by-step instructions to {}.",
    "Explain how to {} for a complete beginner.",
    "What's the easiest way to {}?", "I want to {}. Where should I start?",
    "List the steps needed to {}.", "Can you walk me through how to {}?",
    "What do I need to {}?",
    "What are common mistakes people make when they try to {}?",
    "Write a short guide on how to {}.",
    "In a few short steps, tell me how to {}.",
]


def build_howto(rng):
    return cross(HOWTO_T, HOWTO_TASKS, str.format)


# ---------------------------------------------------------------------------
# advice
# ---------------------------------------------------------------------------

SITUATIONS = [
    "I have trouble falling asleep at night",
    "I'm nervous about giving a presentation next week",
    "my roommate never cleans the kitchen",
    "I want to switch careers but I'm scared",
    "I procrastinate on almost everything",
    "I'm moving to a new city where I don't know anyone",
    "I keep forgetting to drink enough water",
    "my coworker takes credit for my ideas",
    "I spend too much money on takeout",
    "I feel overwhelmed by my to-do list",
    "I want to get back in shape after a long break",
    "my friend and I had an argument and we haven't talked since",
    "I get distracted by my phone when I study",
    "I'm starting my first job on Monday",
    "I have a hard time saying no to people",
    "I'm bored with my daily routine",
    "my kids don't want to eat vegetables",
    "I want to learn to cook but I don't know where to begin",
    "I'm worried about an upcoming exam", "I feel lonely on weekends",
    "I can't decide between two job offers",
    "I have a long commute and it makes me tired",
    "my garden plants keep dying",
    "I want to read more but never find the time",
    "I'm shy and find it hard to talk in groups",
    "I have too much clutter in my apartment",
    "my neighbor plays loud music late at night",
    "I want to start saving for retirement",
    "I get stressed when I have to make phone calls",
    "I'm learning to code and feel stuck",
    "I never have energy in the afternoon",
    "my team missed an important deadline",
    "I want to be more patient with my family",
    "I've been feeling unmotivated at work",
    "I'm planning my first trip abroad",
    "I keep hitting snooze in the morning", "I want to ask for a raise",
    "my dog barks whenever someone walks by",
    "I'm bad at remembering names", "I want to eat less sugar",
    "I'm running a marathon in two months",
    "I just graduated and don't know what to do next",
    "my laptop is slow and I can't afford a new one",
    "I feel nervous before job interviews",
    "I want to make my small apartment feel cozier",
    "I spend too many hours watching videos",
    "I'm taking care of a sick parent and feel exhausted",
    "I want to volunteer but don't know where",
    "I have a big decision to make and keep overthinking it",
    "I'm starting a small online shop",
]
SITUATION_T = [
    "{S}. Any advice?", "{S}. What should I do?", "I need some advice: {s}.",
    "{S}. Can you give me three practical tips?",
    "{S}. How can I handle this better?",
    "{S}. What would you do in my position?",
]

GOALS = [
    "staying focused while working from home", "eating healthier on a budget",
    "keeping a tidy home", "sleeping better", "making small talk",
    "managing time as a student", "staying calm in traffic",
    "being a better listener", "writing clearer emails",
    "keeping plants healthy indoors", "traveling on a tight budget",
    "learning a musical instrument as an adult",
    "building a habit of exercise", "preparing for a long flight",
    "staying warm in winter without high bills",
    "keeping in touch with old friends", "negotiating a lower price",
    "giving constructive feedback", "taking care of a new puppy",
    "remembering what I read", "dealing with a difficult customer",
    "hosting a dinner party", "keeping a journal", "waking up early",
    "practicing a new language every day", "cooking for one person",
    "starting a conversation with a stranger", "staying safe while hiking",
    "running a productive meeting", "making a long drive less boring",
    "getting along with a new roommate", "speaking confidently in public",
    "handling criticism", "organizing digital files", "reducing food waste",
    "keeping a small child entertained on a rainy day",
    "choosing a good used car", "balancing work and hobbies",
    "managing a group project", "staying motivated to learn",
]
GOAL_T = [
    "What are some tips for {}?", "Give me five tips for {}.",
    "How can I get better at {}?", "What's your best advice for {}?",
]


def build_advice(rng):
    groups = [[t.format(S=cap(s), s=s) for s in SITUATIONS] for t in SITUATION_T]
    groups += cross(GOAL_T, GOALS, str.format)
    return groups


# ---------------------------------------------------------------------------
# math (numbers are drawn from the seeded RNG)
# ---------------------------------------------------------------------------

MATH_PREFIX = ["", "", "Solve this: ", "Math question: ",
               "Can you help me with this problem? "]
MATH_SUFFIX = ["", "", " Show your work.", " Explain your steps.",
               " Give just the final answer."]
VEHICLES = ["A train", "A bus", "A cyclist", "A car", "A ship", "A truck",
            "A motorbike"]
NEXT_PLACES = [(10, "ten"), (100, "hundred"), (1000, "thousand")]


def _two_names(r):
    a, b = r.sample(NAMES, 2)
    return a, b


def m_add(r):
    n = r.choice(NAMES)
    it = r.choice(COUNT_ITEMS)
    return "{0} has {1} {2} and buys {3} more. How many {2} does {0} have now?".format(
        n, r.randint(3, 90), it, r.randint(2, 60))


def m_give(r):
    n, m = _two_names(r)
    it = r.choice(COUNT_ITEMS)
    a = r.randint(12, 99)
    return "{0} had {1} {2} and gave {3} of them to {4}. How many {2} does {0} have left?".format(
        n, a, it, r.randint(2, a - 1), m)


def m_boxes(r):
    it = r.choice(COUNT_ITEMS)
    return "A box holds {0} {1}. How many {1} are there in {2} boxes?".format(
        r.randint(4, 48), it, r.randint(3, 25))


def m_share(r):
    n = r.choice(NAMES)
    it = r.choice(COUNT_ITEMS)
    b = r.randint(2, 9)
    return "{0} has {1} {2} to share equally among {3} friends. How many {2} does each friend get?".format(
        n, b * r.randint(3, 15), it, b)


def m_sale(r):
    return "A {} costs ${}. It is on sale for {}% off. What is the sale price?".format(
        r.choice(CLOTHES), r.randrange(20, 205, 5), r.choice([10, 15, 20, 25, 30, 40, 50]))


def m_speed(r):
    unit = r.choice(["km per hour", "miles per hour"])
    dist = "kilometers" if unit.startswith("km") else "miles"
    return "{} travels at {} {} for {} hours. How many {} does it cover?".format(
        r.choice(VEHICLES), r.randrange(15, 125, 5), unit, r.randint(2, 9), dist)


def m_arith(r):
    kind = r.randint(0, 4)
    a, b = r.randint(12, 999), r.randint(11, 999)
    if kind == 0:
        return "What is {} + {}?".format(a, b)
    if kind == 1:
        return "Calculate {} - {}.".format(max(a, b), min(a, b))
    if kind == 2:
        return "What is {} multiplied by {}?".format(r.randint(3, 99), r.randint(3, 99))
    if kind == 3:
        d = r.randint(3, 25)
        return "What is {} divided by {}?".format(d * r.randint(4, 60), d)
    return "What is {} times {}?".format(r.randint(11, 99), r.randint(2, 19))


def m_percent(r):
    return "What is {}% of {}?".format(r.choice([5, 10, 12, 15, 20, 25, 30, 40, 60, 75]),
                                      r.randrange(20, 1020, 20))


def m_linear(r):
    a, x, b = r.randint(2, 12), r.randint(-9, 15), r.randint(1, 40)
    return "Solve for x: {}x + {} = {}.".format(a, b, a * x + b)


def m_rect(r):
    return "A rectangular {} is {} meters wide and {} meters long. What are its area and perimeter?".format(
        r.choice(["garden", "room", "field", "pool", "playground", "parking lot"]),
        r.randint(3, 30), r.randint(5, 60))


def m_pages(r):
    p, k = r.randint(8, 45), r.randint(4, 20)
    return "{} reads {} pages every day. How many days will it take to finish a {}-page book?".format(
        r.choice(NAMES), p, p * k)


def m_saving(r):
    a, k = r.randint(5, 60), r.randint(4, 25)
    return "{} saves ${} every week. How many weeks will it take to save ${}?".format(
        r.choice(NAMES), a, a * k)


def m_recipe(r):
    a, b, k = r.randint(1, 4), r.choice([12, 16, 20, 24, 30]), r.randint(2, 5)
    return "A recipe uses {} cups of flour to make {} cookies. How many cups of flour are needed for {} cookies?".format(
        a, b, b * k)


def m_sequence(r):
    if r.random() < 0.6:
        s, d = r.randint(1, 30), r.randint(2, 13)
        seq = [s + i * d for i in range(5)]
    else:
        s, q = r.randint(1, 5), r.randint(2, 4)
        seq = [s * q ** i for i in range(5)]
    return "What is the next number in the sequence {}, ...?".format(", ".join(map(str, seq)))


def m_prime(r):
    return "Is {} a prime number? Explain why or why not.".format(r.randint(21, 199))


def m_minutes(r):
    return "Convert {} minutes into hours and minutes.".format(r.randint(65, 600))


def m_fraction(r):
    b, d = r.randint(2, 9), r.randint(2, 9)
    return "What is {}/{} + {}/{}? Simplify your answer.".format(
        r.randint(1, b - 1), b, r.randint(1, d - 1), d)


def m_fuel(r):
    return "A car uses {} liters of fuel per 100 km. How much fuel does it need for a {} km trip?".format(
        r.randint(4, 12), r.randrange(50, 900, 50))


def m_round(r):
    mult, word = r.choice(NEXT_PLACES)
    return "Round {} to the nearest {}.".format(r.randint(mult * 3 + 1, mult * 900), word)


def m_ages(r):
    n = r.choice(NAMES)
    return "{0} is {1} years old. {0}'s brother is {2} years older. How old will the brother be in {3} years?".format(
        n, r.randint(5, 40), r.randint(2, 9), r.randint(3, 15))


def m_pizza(r):
    s = r.choice([6, 8, 10, 12])
    return "A pizza is cut into {} equal slices. {} eats {} slices. What fraction of the pizza is left?".format(
        s, r.choice(NAMES), r.randint(1, s - 1))


def m_average(r):
    k = r.randint(3, 6)
    nums = [r.randint(2, 99) for _ in range(k)]
    return "What is the average of {}?".format(", ".join(map(str, nums[:-1])) + " and " + str(nums[-1]))


def m_change(r):
    n = r.choice(NAMES)
    item, price = r.choice(SHOP_ITEMS)
    k = r.randint(2, 5)
    bill = next(b for b in (10, 20, 50, 100) if b > k * price)
    return "{0} buys {1} {2} that cost ${3} each and pays with a ${4} bill. How much change does {0} get?".format(
        n, k, item, price, bill)


def m_time(r):
    h, mm = r.randint(1, 10), r.choice([0, 10, 15, 20, 30, 45, 50])
    return "A movie starts at {}:{:02d} p.m. and lasts {} minutes. What time does it end?".format(
        h, mm, r.randint(85, 170))


def m_square(r):
    n = r.randint(4, 30)
    if r.random() < 0.5:
        return "What is the square root of {}?".format(n * n)
    return "What is {} squared?".format(n)


def m_circle(r):
    return "A circle has a radius of {} cm. What is its area? Use 3.14 for pi.".format(r.randint(2, 20))


def m_wage(r):
    n = r.choice(NAMES)
    return "{0} earns ${1} per hour and works {2} hours this week. How much does {0} earn this week?".format(
        n, r.randint(9, 35), r.randint(8, 45))


def m_packs(r):
    n = r.choice(NAMES)
    it = r.choice(COUNT_ITEMS)
    a, b = r.randint(2, 8), r.randint(4, 12)
    return "{0} buys {1} packs of {2} with {3} in each pack, then gives away {4}. How many {2} are left?".format(
        n, a, it, b, r.randint(1, a * b - 1))


def m_units(r):
    k = r.randint(0, 3)
    v = r.randint(2, 40)
    return [
        "How many centimeters are in {} meters?",
        "How many grams are in {} kilograms?",
        "How many seconds are in {} minutes?",
        "How many milliliters are in {} liters?",
    ][k].format(v)


def m_ratio(r):
    a, b = r.randint(1, 5), r.randint(1, 5)
    return "The ratio of boys to girls in a class is {}:{}. If there are {} students, how many girls are there?".format(
        a, b, (a + b) * r.randint(3, 7))


def m_sumdiff(r):
    x, y = r.randint(10, 80), r.randint(1, 60)
    x, y = max(x, y), min(x, y)
    return "The sum of two numbers is {} and their difference is {}. What are the numbers?".format(x + y, x - y)


def m_square_perim(r):
    return "A square has a perimeter of {} cm. How long is each side?".format(4 * r.randint(2, 40))


def m_growth(r):
    p = r.randrange(1000, 20000, 500)
    g = r.choice([2, 4, 5, 10, 20, 25])
    return "A town had {} residents last year and {} this year. By what percent did the population grow?".format(
        p, p + p * g // 100)


def m_order_ops(r):
    a, b, c = r.randint(2, 20), r.randint(2, 12), r.randint(2, 9)
    if r.random() < 0.5:
        return "Evaluate {} + {} × {}.".format(a, b, c)
    return "What is ({} + {}) × {}?".format(a, b, c)


def m_algebra(r):
    a, b, c = r.randint(2, 9), r.randint(2, 9), r.randint(1, 20)
    if r.random() < 0.5:
        return "Simplify {}x + {}x - {}.".format(a, b, c)
    return "Expand {}(x + {}).".format(a, c)


def m_temp(r):
    return "The temperature was {}°C in the morning and dropped by {} degrees by night. What was the temperature at night?".format(
        r.randint(-5, 25), r.randint(3, 20))


MATH_GENS = [
    m_add, m_give, m_boxes, m_share, m_sale, m_speed, m_arith, m_percent,
    m_linear, m_rect, m_pages, m_saving, m_recipe, m_sequence, m_prime,
    m_minutes, m_fraction, m_fuel, m_round, m_ages, m_pizza, m_average,
    m_change, m_time, m_square, m_circle, m_wage, m_packs, m_units, m_ratio,
    m_sumdiff, m_square_perim, m_growth, m_order_ops, m_algebra, m_temp,
]


def _wrap_math(r, body):
    return r.choice(MATH_PREFIX) + body + r.choice(MATH_SUFFIX)


def build_math(rng):
    return [[_wrap_math(rng, g(rng)) for _ in range(30)] for g in MATH_GENS]


# ---------------------------------------------------------------------------
# reasoning
# ---------------------------------------------------------------------------

COMPARATIVES = [
    ("taller", "shortest", "tallest"), ("older", "youngest", "oldest"),
    ("faster", "slowest", "fastest"), ("heavier", "lightest", "heaviest"),
]
NONSENSE = ["bloops", "razzies", "lazzies", "trimbles", "zorks", "fleems",
            "gliffs", "wugs", "snarps", "dax"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday",
        "Sunday"]
ODD_ONE_OUT = [
    ["apple", "banana", "carrot", "cherry"], ["piano", "guitar", "violin", "hammer"],
    ["Mars", "Venus", "Jupiter", "Moon"], ["whale", "shark", "dolphin", "seal"],
    ["circle", "square", "triangle", "cube"], ["red", "blue", "green", "square"],
    ["oak", "pine", "rose", "maple"], ["eagle", "penguin", "sparrow", "bat"],
    ["2", "4", "7", "8"], ["Paris", "Rome", "Spain", "Berlin"],
    ["copper", "iron", "plastic", "gold"], ["January", "March", "Tuesday", "June"],
    ["knife", "fork", "spoon", "plate"], ["tennis", "chess", "soccer", "basketball"],
    ["run", "jump", "happy", "swim"], ["9", "16", "25", "30"],
]
CONDITIONALS = [
    ("it is raining", "the ground is wet"),
    ("a number is divisible by 4", "it is even"),
    ("the store is open", "the lights are on"),
    ("an animal is a dog", "it is a mammal"),
    ("the alarm rings", "Sam wakes up"),
    ("it is below zero outside", "the pond freezes"),
    ("the battery is dead", "the phone will not turn on"),
    ("you water the plant", "it grows"),
]


def ordinal(n):
    if 10 <= n % 100 <= 20:
        suf = "th"
    else:
        suf = {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return "{}{}".format(n, suf)


def r_order(r):
    comp, least, most = r.choice(COMPARATIVES)
    a, b, c = r.sample(NAMES, 3)
    ask = r.choice([least, most])
    return "{} is {} than {}, and {} is {} than {}. Who is the {}?".format(a, comp, b, b, comp, c, ask)


def r_order4(r):
    comp, least, most = r.choice(COMPARATIVES)
    a, b, c, d = r.sample(NAMES, 4)
    return "{1} is {0} than {2}. {3} is {0} than {1}. {2} is {0} than {4}. Put them in order from the {5} to the {6}.".format(
        comp, b, c, a, d, most, least)


def r_syllogism(r):
    x, y, z = r.sample(NONSENSE, 3)
    if r.random() < 0.5:
        return "All {0} are {1}, and all {1} are {2}. Are all {0} {2}? Explain.".format(x, y, z)
    return "All {0} are {1}. Some {1} are {2}. Does it follow that some {0} are {2}? Explain.".format(x, y, z)


def r_days(r):
    return "If today is {}, what day of the week will it be in {} days?".format(
        r.choice(DAYS), r.randint(3, 100))


def r_clock(r):
    return "It is {} o'clock now. What time will it be in {} hours?".format(
        r.randint(1, 12), r.randint(5, 50))


def r_handshakes(r):
    return "At a meeting, {} people each shake hands with every other person exactly once. How many handshakes are there?".format(
        r.randint(4, 25))


def r_odd(r):
    items = list(r.choice(ODD_ONE_OUT))
    r.shuffle(items)
    return "Which one does not belong: {}? Explain why.".format(", ".join(items))


def r_socks(r):
    c1, c2 = r.sample(["red", "blue", "black", "white", "green", "gray"], 2)
    return "A drawer has {} {} socks and {} {} socks. How many socks must you take out without looking to be sure you have a matching pair?".format(
        r.randint(3, 20), c1, r.randint(3, 20), c2)


def r_legs(r):
    cows, hens = r.randint(2, 20), r.randint(2, 30)
    return "A farm has chickens and cows. Together they have {} heads and {} legs. How many cows are there?".format(
        cows + hens, 4 * cows + 2 * hens)


def r_conditional(r):
    p, q = r.choice(CONDITIONALS)
    form = r.randint(0, 2)
    if form == 0:
        return "If {}, then {}. We know that {}. What can we conclude?".format(p, q, p)
    if form == 1:
        return "If {}, then {}. We observe that {}. Can we be sure that {}? Explain.".format(p, q, q, p)
    return "If {}, then {}. We find out that it is not true that {}. What can we conclude about whether {}?".format(p, q, q, p)


def r_age(r):
    n, m = _two_names(r)
    a, k = r.randint(4, 20), r.randint(1, 6)
    return "In {} years, {} will be twice as old as {} is now. {} is {} years old now. How old is {} now?".format(
        k, n, m, m, a, n)


def r_line(r):
    n = r.choice(NAMES)
    return "{} is {} in line from the front and {} from the back. How many people are in the line?".format(
        n, ordinal(r.randint(2, 30)), ordinal(r.randint(2, 30)))


def r_fence(r):
    d = r.choice([2, 3, 4, 5])
    return "A straight fence is {} meters long with a post every {} meters, including both ends. How many posts are there?".format(
        d * r.randint(3, 30), d)


def r_letters(r):
    step = r.randint(1, 4)
    start = r.randint(0, 25 - 5 * step)
    seq = [chr(ord("A") + start + i * step) for i in range(4)]
    return "What letter comes next: {}, ...?".format(", ".join(seq))


REASONING_GENS = [
    r_order, r_order4, r_syllogism, r_days, r_clock, r_handshakes, r_odd,
    r_socks, r_legs, r_conditional, r_age, r_line, r_fence, r_letters,
]


def build_reasoning(rng):
    return [[g(rng) for _ in range(20)] for g in REASONING_GENS]


# ---------------------------------------------------------------------------
# code
# ---------------------------------------------------------------------------

LANGS = ["Python", "JavaScript", "C", "Java", "Rust", "Go"]
FENCE = {"Python": "python", "JavaScript": "javascript", "C": "c",
         "Java": "java", "Rust": "rust", "Go": "go", "SQL": "sql",
         "Bash": "bash"}

FUNC_TASKS = [
    "reverses a string", "checks whether a number is prime",
    "returns the largest number in a list", "counts the vowels in a string",
    "computes the factorial of a number", "returns the nth Fibonacci number",
    "removes duplicate values from a list",
    "checks whether a string is a palindrome",
    "converts a temperature from Celsius to Fahrenheit",
    "adds up the digits of an integer",
    "merges two sorted arrays into one sorted array",
    "finds the second largest number in an array",
    "capitalizes the first letter of every word in a sentence",
    "computes the greatest common divisor of two integers",
    "checks whether a year is a leap year",
    "counts how many times a character appears in a string",
    "returns the average of an array of numbers",
    "checks whether two strings are anagrams",
    "performs binary search on a sorted array",
    "sorts an array using bubble sort", "converts a decimal number to binary",
    "returns the sum of all even numbers up to n",
    "finds the minimum and maximum of a list in one pass",
    "rotates an array to the right by k positions",
    "checks whether a list is sorted", "counts the words in a sentence",
    "returns the index of the first negative number, or -1 if there is none",
    "raises a number to an integer power without a built-in power function",
    "checks whether the brackets in a string are balanced",
    "returns the number of days in a given month",
    "converts a Roman numeral to an integer",
    "computes the running total of a list of numbers",
    "removes all spaces from a string", "finds the longest word in a sentence",
    "returns the common elements of two lists",
    "generates the first n prime numbers",
    "converts a number of seconds into hours, minutes, and seconds",
    "checks whether a number is a perfect square",
    "computes the dot product of two vectors", "transposes a matrix",
    "checks that a string contains only digits",
    "prints FizzBuzz for the numbers 1 to n",
    "calculates simple interest from principal, rate, and time",
    "counts the number of 1 bits in an integer",
    "clamps a value between a minimum and a maximum",
]
FUNC_T = [
    "Write a {l} function that {t}.",
    "In {l}, how would I write a function that {t}?",
    "Show me {l} code for a function that {t}.",
    "Implement a {l} function that {t}. Add a short comment explaining how it works.",
    "Write a short {l} function that {t}, and show one example of calling it.",
]

OPS = [
    "read a text file line by line", "sort a list of numbers",
    "parse a JSON string", "handle errors", "loop over the keys and values of a map",
    "get the current date and time", "convert a string to an integer",
    "split a string by commas", "write text to a file",
    "generate a random number", "define a type with two fields",
    "join a list of strings with a separator",
    "check if a string contains a substring",
    "measure how long a piece of code takes to run",
    "create a growable array and append to it",
]
OPS_T = [
    "How do I {o} in {l}?", "What is the idiomatic way to {o} in {l}?",
    "Give me a short {l} example that shows how to {o}.",
]

CONCEPTS = {
    "Python": ["decorators", "list comprehensions", "generators",
               "the __init__ method", "virtual environments", "the with statement"],
    "JavaScript": ["closures", "promises", "the this keyword",
                   "async and await", "arrow functions", "the event loop"],
    "C": ["pointers", "malloc and free", "null-terminated strings",
          "segmentation faults", "header files"],
    "Java": ["the static keyword", "garbage collection", "checked exceptions",
             "generics", "the main method"],
    "Rust": ["ownership", "borrowing", "Option and Result", "lifetimes",
             "traits"],
    "Go": ["goroutines", "channels", "the defer statement", "interfaces",
           "error handling"],
    "SQL": ["indexes", "GROUP BY", "primary keys", "transactions", "views"],
    "Bash": ["pipes", "exit codes", "environment variables",
             "file permissions and chmod", "for loops"],
}
CONCEPT_T = [
    "Explain {c} in {l} with a small example.",
    "Can you explain {c} in {l}?",
    "What should a beginner know about {c} in {l}?",
]
DIFFS = [
    ("Python", "a list", "a tuple"), ("Python", "is", "=="),
    ("JavaScript", "let", "var"), ("JavaScript", "==", "==="),
    ("C", "the stack", "the heap"), ("C", "an array", "a pointer"),
    ("Java", "an interface", "an abstract class"),
    ("Java", "ArrayList", "LinkedList"), ("Rust", "String", "&str"),
    ("Rust", "Box", "Rc"), ("Go", "arrays", "slices"),
    ("Go", "a value receiver", "a pointer receiver"),
    ("SQL", "INNER JOIN", "LEFT JOIN"), ("SQL", "WHERE", "HAVING"),
    ("Bash", "single quotes", "double quotes"), ("Bash", "[ ]", "[[ ]]"),
]
DIFF_T = [
    "In {l}, what is the difference between {a} and {b}?",
    "When should I use {a} instead of {b} in {l}?",
]

SNIPPETS = [
    ("Python", r'''def f(words):
    counts = {}
    for w in words:
        counts[w] = counts.get(w, 0) + 1
    return counts'''),
    ("Python", r'''nums = [3, 8, 1, 9, 4]
evens = [n * n for n in nums if n % 2 == 0]
print(evens)'''),
    ("Python", r'''def is_sorted(xs):
    return all(a <= b for a, b in zip(xs, xs[1:]))'''),
    ("Python", r'''with open("data.txt") as fh:
    total = sum(int(line) for line in fh if line.strip())
print(total)'''),
    ("JavaScript", r'''const double = arr => arr.map(x => x * 2);
console.log(double([1, 2, 3]));'''),
    ("JavaScript", r'''function debounce(fn, ms) {
  let timer;
  return (...args) => {
    clearTimeout(timer);
    timer = setTimeout(() => fn(...args), ms);
  };
}'''),
    ("JavaScript", r'''const users = [{ name: "Ana", age: 31 }, { name: "Ben", age: 17 }];
const adults = users.filter(u => u.age >= 18).map(u => u.name);'''),
    ("C", r'''int sum(int *a, int n) {
    int s = 0;
    for (int i = 0; i < n; i++) s += a[i];
    return s;
}'''),
    ("C", r'''#include <stdio.h>
int main(void) {
    for (int i = 1; i <= 3; i++)
        printf("%d\n", i * i);
    return 0;
}'''),
    ("C", r'''void swap(int *x, int *y) {
    int t = *x;
    *x = *y;
    *y = t;
}'''),
    ("Java", r'''public static int countChar(String s, char c) {
    int n = 0;
    for (char ch : s.toCharArray()) {
        if (ch == c) n++;
    }
    return n;
}'''),
    ("Java", r'''List<String> names = new ArrayList<>(List.of("Zoe", "Adam", "Mia"));
Collections.sort(names);
System.out.println(names);'''),
    ("Rust", r'''fn largest(v: &[i32]) -> Option<i32> {
    v.iter().copied().max()
}'''),
    ("Rust", r'''let words = vec!["apple", "kiwi", "banana"];
let lens: Vec<usize> = words.iter().map(|w| w.len()).collect();
println!("{:?}", lens);'''),
    ("Go", r'''func reverse(s []int) {
    for i, j := 0, len(s)-1; i < j; i, j = i+1, j-1 {
        s[i], s[j] = s[j], s[i]
    }
}'''),
    ("Go", r'''m := map[string]int{"a": 1, "b": 2}
for k, v := range m {
    fmt.Println(k, v)
}'''),
    ("SQL", r'''SELECT department, AVG(salary) AS avg_salary
FROM employees
GROUP BY department
HAVING AVG(salary) > 50000;'''),
    ("SQL", r'''SELECT c.name, COUNT(o.id) AS order_count
FROM customers c
LEFT JOIN orders o ON o.customer_id = c.id
GROUP BY c.name;'''),
    ("Bash", r'''for f in *.log; do
  echo "$f: $(wc -l < "$f") lines"
done'''),
    ("Bash", r'''grep -rih "error" logs/ | sort | uniq -c | sort -rn | head -n 5'''),
]
SNIPPET_T = [
    "Explain what this {l} code does:\n\n```{f}\n{c}\n```",
    "What does the following {l} snippet do? Walk through it line by line.\n\n```{f}\n{c}\n```",
    "Add helpful comments to this {l} code:\n\n```{f}\n{c}\n```",
    "Can this {l} code be written more clearly? Suggest an improved version.\n\n```{f}\n{c}\n```",
]
TRANSLATE_T = "Translate this {l} code into {o}:\n\n```{f}\n{c}\n```"

BUGS = [
    ("Python", "return the average of a list", "it crashes when the list is empty",
     r'''def average(nums):
    return sum(nums) / len(nums)'''),
    ("Python", "return the last element of a list", "it raises an IndexError",
     r'''def last(items):
    return items[len(items)]'''),
    ("Python", "start with an empty bucket on every call",
     "it keeps items from previous calls",
     r'''def add_item(item, bucket=[]):
    bucket.append(item)
    return bucket'''),
    ("Python", "find a word in a list while ignoring case",
     "it misses matches like 'Apple' vs 'APPLE'",
     r'''def contains(words, target):
    for w in words:
        if w.lower() == target:
            return True
    return False'''),
    ("JavaScript", "add up the numbers in an array",
     "it returns a string like '0123'",
     r'''function total(values) {
  let sum = "0";
  for (const v of values) sum += v;
  return sum;
}'''),
    ("JavaScript", "print 0, 1 and 2", "it prints 3 three times",
     r'''for (var i = 0; i < 3; i++) {
  setTimeout(() => console.log(i), 100);
}'''),
    ("C", "return a copy of a string", "it sometimes crashes or prints junk",
     r'''char *copy(const char *s) {
    char *out = malloc(strlen(s));
    strcpy(out, s);
    return out;
}'''),
    ("C", "return the sum of the numbers from 1 to n",
     "it returns a different wrong number each run",
     r'''int sum_to(int n) {
    int s;
    for (int i = 1; i <= n; i++) s += i;
    return s;
}'''),
    ("Java", "check whether two names are equal",
     "it says they differ even when they look the same",
     r'''boolean sameName(String a, String b) {
    return a == b;
}'''),
    ("Java", "return the largest value in an array",
     "it throws an ArrayIndexOutOfBoundsException",
     r'''int max(int[] a) {
    int m = a[0];
    for (int i = 0; i <= a.length; i++) {
        if (a[i] > m) m = a[i];
    }
    return m;
}'''),
    ("Rust", "print two strings", "it does not compile",
     r'''fn main() {
    let s = String::from("hi");
    let t = s;
    println!("{} {}", s, t);
}'''),
    ("Rust", "count the even values in a vector",
     "the compiler reports a type mismatch",
     r'''fn count_even(v: Vec<i32>) -> i32 {
    v.iter().filter(|x| *x % 2 == 0).count()
}'''),
    ("Go", "add an item to a slice", "the caller never sees the new item",
     r'''func addItem(items []string, item string) {
    items = append(items, item)
}'''),
    ("Go", "print the numbers 0 to 9", "the loop never ends",
     r'''i := 0
for i < 10 {
    fmt.Println(i)
}'''),
    ("SQL", "count the orders for each customer", "the database reports an error",
     r'''SELECT customer_id, COUNT(*)
FROM orders;'''),
    ("Bash", "print the name of each file in the folder",
     "it breaks on file names that contain spaces",
     r'''for f in $(ls); do
  echo $f
done'''),
]
BUG_T = [
    "This {l} code should {g}, but {s}. Can you fix it?\n\n```{f}\n{c}\n```",
    "Find the bug in this {l} code. It is supposed to {g}, but {s}.\n\n```{f}\n{c}\n```",
    "Why doesn't this {l} code work? It should {g}, but {s}.\n\n```{f}\n{c}\n```",
]

SQL_TASKS = [
    ("a table employees(id, name, department, salary, hire_date)", "list the five highest-paid employees"),
    ("a table employees(id, name, department, salary, hire_date)", "count the employees in each department"),
    ("a table employees(id, name, department, salary, hire_date)", "find employees hired after January 1, 2020"),
    ("a table orders(id, customer_id, total, created_at)", "find the total revenue per month"),
    ("a table orders(id, customer_id, total, created_at)", "find customers who placed more than three orders"),
    ("a table products(id, name, category, price, stock)", "find all products that are out of stock"),
    ("a table products(id, name, category, price, stock)", "show the average price in each category"),
    ("a table products(id, name, category, price, stock)", "raise the price of every product in the 'toys' category by 10 percent"),
    ("tables students(id, name) and scores(student_id, subject, score)", "find each student's average score"),
    ("tables students(id, name) and scores(student_id, subject, score)", "list students who have no scores recorded"),
    ("a table books(id, title, author, year)", "find all books published before 1950, newest first"),
    ("a table books(id, title, author, year)", "find authors who have written more than two books"),
    ("a table users(id, email, created_at)", "find duplicate email addresses"),
    ("a table flights(id, origin, destination, departure_time)", "find the origin airport with the most departures"),
    ("a table movies(id, title, genre, rating)", "find the highest-rated movie in each genre"),
    ("a table sales(id, store, amount, sale_date)", "find the store with the highest total sales in 2023"),
    ("a table patients(id, name, birth_date)", "find patients who are older than 65"),
    ("a table messages(id, sender_id, receiver_id, sent_at)", "count the messages sent by each user per day"),
    ("a table tasks(id, title, status, due_date)", "find overdue tasks that are not done yet"),
    ("a table rentals(id, bike_id, start_time, end_time)", "find the average rental duration in minutes"),
]
SQL_T = [
    "Write a SQL query to {t}, given {s}.",
    "Given {s}, how do I write a SQL query to {t}?",
    "I have {s}. Write a query to {t}.",
]

BASH_TASKS = [
    "count the lines in every .txt file in a folder",
    "rename all .jpeg files in a folder to .jpg",
    "find files larger than 100 MB", "delete log files older than 7 days",
    "print the 10 most common words in a text file",
    "check whether a file exists before reading it",
    "back up a directory into a dated tar.gz archive",
    "show which process is using port 8080",
    "print the even numbers from 1 to 20",
    "replace every 'foo' with 'bar' in all .py files",
    "find all files modified in the last 24 hours",
    "show the disk usage of each subfolder sorted by size",
    "print the second column of a CSV file",
    "download a web page and save it to a file",
    "ask the user for their name and greet them",
    "watch a log file and print lines containing ERROR",
    "create five empty files named file1.txt to file5.txt",
    "check whether a command-line argument was given",
    "convert all file names in a folder to lowercase",
    "count how many user accounts are listed in /etc/passwd",
    "run a command every 5 seconds", "compare two files and show the differences",
]
BASH_T = [
    "Write a bash script to {}.",
    "How can I {} from the Linux command line?",
    "Give me a shell command to {}.",
]


def build_code(rng):
    groups = []
    for t in FUNC_T:
        groups.append([t.format(l=l, t=task) for task in FUNC_TASKS for l in LANGS])
    for t in OPS_T:
        groups.append([t.format(o=o, l=l) for o in OPS for l in LANGS])
    for t in CONCEPT_T:
        groups.append([t.format(c=c, l=l) for l in CONCEPTS for c in CONCEPTS[l]])
    for t in DIFF_T:
        groups.append([t.format(l=l, a=a, b=b) for l, a, b in DIFFS])
    for t in SNIPPET_T:
        groups.append([t.format(l=l, f=FENCE[l], c=c) for l, c in SNIPPETS])
    trans = []
    for l, c in SNIPPETS:
        if l in LANGS:
            for o in LANGS:
                if o != l:
                    trans.append(TRANSLATE_T.format(l=l, o=o, f=FENCE[l], c=c))
    groups.append(trans)
    for t in BUG_T:
        groups.append([t.format(l=l, g=g, s=s, f=FENCE[l], c=c) for l, g, s, c in BUGS])
    groups += [[t.format(t=task, s=schema) for schema, task in SQL_TASKS] for t in SQL_T]
    groups += cross(BASH_T, BASH_TASKS, str.format)
    return groups


# ---------------------------------------------------------------------------
# summarize (short original paragraphs)
# ---------------------------------------------------------------------------

PARAGRAPHS = [
    "The town of Millbrook voted last week to turn an empty parking lot into a community garden. Volunteers will build raised beds this spring, and families can rent a plot for a small yearly fee. Organizers hope the garden will provide fresh vegetables and a place for neighbors to meet. Any extra produce will be donated to the local food bank.",
    "Honeybees share the location of flowers through a movement called the waggle dance. A returning bee walks in a figure-eight pattern, and the angle of its straight run shows the direction of the food relative to the sun. The length of the run tells other bees how far away the flowers are. Bees that watch the dance then fly out to find the source.",
    "Many people believe that reading in dim light permanently damages the eyes. Eye doctors say it can cause temporary strain, dryness, or headaches, but there is no evidence of lasting harm. The discomfort usually goes away after a rest. Good lighting still makes reading more comfortable.",
    "A small software company recently tried a four-day work week as an experiment. After six months, managers reported that projects were finished on time and fewer employees took sick days. Some staff said it was harder to schedule meetings with clients. The company plans to keep the new schedule but review it again next year.",
    "The library's new lending program lets residents borrow tools instead of books. Items include drills, ladders, sewing machines, and even a pressure washer. Borrowers need a library card and must return items within one week. The program is meant to save people money and reduce waste.",
    "Octopuses are known for their intelligence. They can solve simple puzzles, open jars, and escape from tanks. Each of their eight arms contains many neurons, so the arms can react to touch and taste somewhat independently. Scientists study them to learn how intelligence can evolve in animals very different from us.",
    "During the storm on Tuesday night, strong winds knocked down several trees along River Road, and about two thousand homes lost power. Repair crews worked through the night, and most electricity was restored by Wednesday afternoon. City officials asked residents to stay away from fallen lines. Schools opened two hours late.",
    "Learning a musical instrument as an adult can be rewarding, even if progress feels slow. Short daily practice sessions tend to work better than long weekly ones. Many adult learners set small goals, like learning one song a month. Playing with other people can also keep motivation high.",
    "The ancient city of Petra, in present-day Jordan, was carved directly into rose-colored sandstone cliffs. More than two thousand years ago it was an important trading center on routes linking Arabia, Egypt, and the Mediterranean. Its builders created clever systems to collect and store rainwater. Today it is one of the most visited historical sites in the region.",
    "A recent survey of 500 commuters found that most people would ride the bus more often if it came more frequently. Cost was the second most common concern, followed by safety at bus stops. Only a few said they preferred driving because they enjoyed it. The transit authority says it will use the results to plan new routes.",
    "Sourdough bread is made with a starter, a mixture of flour and water that contains wild yeast and bacteria. The starter must be fed regularly to stay active. In the dough it produces gas that makes the bread rise and acids that give it a tangy flavor. The process is slower than using packaged yeast, but many bakers prefer the result.",
    "The school robotics team won second place at the regional competition on Saturday. Their robot, built partly from recycled parts, had to sort colored blocks within two minutes. The team captain said they lost points when a motor overheated during the final round. They have already started improving the design for next year.",
    "Sleep plays an important role in memory. During deep sleep, the brain replays and organizes information learned during the day. Students who sleep well after studying tend to remember more than those who stay up late. Experts recommend a regular sleep schedule, especially before exams.",
    "Plastic bottles can take hundreds of years to break down in nature. Many cities now encourage people to carry reusable bottles and have installed public water fountains. Some cafés give discounts to customers who bring their own cups. Each step is small, but together they can prevent a large amount of waste.",
    "The town's first public museum has opened in an old railway station. Its collection includes photographs, maps, and tools used by the families who founded the settlement. Entry is free on Sundays, and school groups can book guided tours. The museum also invites residents to donate items that tell the town's story.",
    "A password manager is an app that stores all of your passwords in an encrypted vault. You only need to remember one strong master password. Most managers can also create long random passwords and fill them in automatically. Security experts say this is safer than reusing the same password on many websites.",
    "Mangrove forests grow along tropical coastlines where salt water meets land. Their tangled roots protect shores from erosion and storm waves. They also shelter young fish, crabs, and birds. Unfortunately, many mangrove areas have been cleared for farming and construction.",
    "Yesterday's match between the Harbor City Gulls and the Valley Rangers ended in a 2-2 draw. The Gulls scored twice in the first half, but the Rangers came back with two late goals. The Rangers' goalkeeper made an important save in the final minute. Both teams remain in the top four of the league.",
    "Writing notes by hand may help people remember them better than typing. Researchers think this is because handwriting is slower, which pushes the writer to summarize and process ideas. Typing makes it easy to copy words without thinking about them. On the other hand, typed notes are easier to search and share.",
    "The bakery on Elm Street will close for two weeks in August for renovations. The owners plan to add more seating and a larger oven. During the closure, their bread will still be sold at the Saturday farmers market. The bakery will reopen with a small celebration and free samples.",
    "Glaciers form when snow builds up over many years and is pressed into ice. They move slowly downhill under their own weight. As they move, they carve valleys and carry rocks over long distances. Many glaciers around the world are shrinking as average temperatures rise.",
    "Before they built airplanes, the Wright brothers ran a bicycle shop. Their experience with light machines and balance helped them design a way to steer an aircraft in flight. In 1903 they made the first powered, controlled flight near Kitty Hawk, North Carolina. That first flight lasted only about twelve seconds.",
    "Volunteers at the animal shelter walk dogs, clean kennels, and help at adoption events. The shelter says volunteers make a big difference because staff are often busy with medical care. New volunteers attend a short training session on handling animals safely. Anyone over sixteen can apply online.",
    "A budget is a plan for how to spend and save money. It starts with a list of income and regular expenses such as rent, food, and transport. The money left over can be split between savings and other goals. Reviewing the budget every month helps people notice where they might be overspending.",
    "In many cultures, tea is more than a drink; it is a social ritual. In some places guests are always offered tea as a sign of welcome. Different regions prepare it in very different ways, from strong and sweet to light and plain. Sharing a cup is often a way to slow down and talk.",
    "The new bike lanes downtown were finished last month. Early counts show that the number of cyclists on Main Street has nearly doubled. Some shop owners worried about losing parking spaces, but several now say more customers stop by on bikes. The city will collect more data before deciding whether to extend the lanes.",
    "Solar panels turn sunlight into electricity using thin layers of silicon. When light hits the panel, it knocks electrons loose and creates an electric current. The amount of power depends on the panel's size, its angle, and how much sun it receives. Panel prices have fallen sharply over the past decade.",
    "Camels are well suited to life in the desert. They can go for days without drinking and then drink a large amount of water very quickly. Their humps store fat rather than water, which they can use for energy. Long eyelashes and closable nostrils protect them from blowing sand.",
]
SUMMARY_T = [
    "Summarize the following paragraph in one sentence:\n\n{}",
    "Give a short summary of this text:\n\n{}",
    "{}\n\nWhat is the main point of the paragraph above?",
    "Read this and summarize it in three bullet points:\n\n{}",
    "Write a TL;DR for this:\n\n{}",
    "Summarize this for a young child:\n\n{}",
    "Here is a paragraph:\n\n{}\n\nSum it up in under 20 words.",
]


def build_summarize(rng):
    return cross(SUMMARY_T, PARAGRAPHS, str.format)


# ---------------------------------------------------------------------------
# list
# ---------------------------------------------------------------------------

LIST_SUBJECTS = [
    "fruits that are high in vitamin C", "countries in South America",
    "ways to reduce stress", "programming languages used for web development",
    "board games for families", "healthy breakfast ideas",
    "famous scientists and what they discovered", "ways to save energy at home",
    "hobbies you can do indoors", "questions to ask at the end of a job interview",
    "animals that live in the Arctic", "tips for a long car ride",
    "vegetables that grow well in containers", "classic novels worth reading",
    "things to pack for a beach day", "exercises you can do without equipment",
    "ways to be kind to a neighbor", "inventions that changed daily life",
    "planets in our solar system", "musical instruments from around the world",
    "reasons to learn a second language", "ways to make a small room feel bigger",
    "common mistakes new drivers make", "things to do on a rainy day",
    "birds you might see in a city park", "tips for writing a good essay",
    "snacks that are easy to make", "ways to stay cool in summer",
    "careers that involve working with animals", "skills every adult should learn",
    "foods that are good sources of protein", "names for a pet goldfish",
    "ideas for a science fair project", "household uses for baking soda",
    "questions to ask a new friend", "ways to reduce plastic use",
    "features of a good website", "animals that live in the ocean",
    "qualities of a good team leader", "gift ideas for a grandparent",
    "spices used in Indian cooking", "famous bridges around the world",
    "ways to improve sleep", "outdoor games for kids",
    "things to check before a long bike ride", "benefits of walking every day",
    "ways to practice gratitude", "tools every home should have",
    "types of clouds", "signs that a houseplant needs water",
    "ideas for a picnic menu", "words that rhyme with 'light'",
    "fun facts about the ocean", "ways to learn new vocabulary",
    "parts of a computer", "important events of the 20th century",
    "ways to stay productive in the afternoon",
    "dog breeds that are good with children", "cheap date ideas",
    "things to do in a new city", "ways to reuse glass jars",
    "common Linux commands", "useful keyboard shortcuts",
    "tips for a first-time gardener", "types of renewable energy",
    "herbs that are easy to grow", "topics for a short speech",
    "ways to make a morning routine easier", "desserts that don't need an oven",
    "rivers in Africa", "famous paintings", "ways to stay safe online",
]
LIST_T = [
    "List {n} {s}.", "Name {n} {s}.", "Give me a list of {n} {s}.",
    "What are {n} {s}? Just list them.",
    "List {n} {s}, with a one-line description of each.",
    "Make a numbered list of {n} {s}.",
]


def build_list(rng):
    return [[t.format(n=rng.randint(3, 10), s=s) for s in LIST_SUBJECTS] for t in LIST_T]


# ---------------------------------------------------------------------------
# creative
# ---------------------------------------------------------------------------

CREATIVE_SUBJECTS = [
    "a lighthouse keeper", "the first snow of winter",
    "a lost robot looking for home", "a cat who wants to fly",
    "a rainy city street", "the ocean at night", "an old oak tree",
    "a dragon who is afraid of the dark", "a busy morning at a bakery",
    "a forgotten umbrella", "a train journey through the mountains",
    "a child's first day at school", "the last leaf on a branch",
    "a friendship between a fox and a crow", "a summer thunderstorm",
    "a small boat on a big sea", "a grandmother's kitchen",
    "the Moon talking to the Sun", "a library at midnight",
    "a penguin who moves to the desert", "a garden in spring",
    "a kite that escapes", "a clock that runs backward",
    "a quiet Sunday morning", "a street musician",
    "a snowman who wants to see summer", "an astronaut looking back at Earth",
    "a hidden door in a school", "a cup of hot cocoa", "autumn leaves",
    "a sleepy village", "a time traveler's first coffee",
    "a brave little turtle", "the sound of rain on a roof",
    "a mountain sunrise", "a robot learning to paint", "a lost sock",
    "a firefly in the woods", "moving to a new house",
    "a bicycle ride at dusk", "a message in a bottle", "a city waking up",
    "a mouse who runs a restaurant", "the smell of fresh bread",
    "two strangers sharing an umbrella", "a desert at noon", "a whale singing",
    "a wish made on a star", "an old photograph",
    "a tiny kingdom under a bridge", "the end of summer vacation",
    "a chess game between old friends", "a magician who forgets his tricks",
    "a river finding the sea", "a snail in a hurry",
    "a spaceship made of cardboard", "a cozy winter cabin",
    "a surprise birthday party", "a bee's busy day", "the first day of spring",
]
TONES = ["calm", "joyful", "mysterious", "nostalgic", "hopeful", "playful",
         "melancholy"]
CREATIVE_T = [
    "Write a haiku about {}.", "Write a short poem about {}.",
    "Write a very short story about {}.", "Write a limerick about {}.",
    "Tell me a bedtime story about {}.", "Write a four-line rhyming poem about {}.",
    "Write a short story about {} that ends with a surprise.",
    "Write a two-paragraph story about {} for young children.",
]
CHARACTERS = [
    "a pirate captain", "a house cat", "a retired astronaut",
    "a medieval knight", "a nervous new teacher", "a talking tree",
    "a detective", "a robot vacuum cleaner", "a baker", "an old lighthouse",
    "a soccer ball", "a traveling musician", "a grumpy wizard",
    "a young inventor", "a librarian", "a goldfish", "an alien tourist",
    "a mountain goat", "a chef", "a museum guard", "a city pigeon",
    "a farmer", "a superhero on a day off", "a tired parent", "a lost dog",
    "a ghost who is scared of people", "a tiny dragon", "a weather forecaster",
]


def build_creative(rng):
    groups = cross(CREATIVE_T, CREATIVE_SUBJECTS, str.format)
    groups.append(["Write a free-verse poem about {} in a {} mood.".format(s, rng.choice(TONES))
                   for s in CREATIVE_SUBJECTS])
    groups.append(["Write a diary entry from the point of view of {}.".format(c) for c in CHARACTERS])
    groups.append(["Write a short monologue spoken by {}.".format(c) for c in CHARACTERS])
    pairs = []
    for i, a in enumerate(CHARACTERS):
        b = CHARACTERS[(i * 7 + 3) % len(CHARACTERS)]
        if a != b:
            pairs.append("Write a short dialogue between {} and {}.".format(a, b))
    groups.append(pairs)
    return groups


# ---------------------------------------------------------------------------
# compare
# ---------------------------------------------------------------------------

PAIRS = [
    ("cats", "dogs"), ("tea", "coffee"), ("Python", "JavaScript"),
    ("renting a home", "buying a home"), ("weather", "climate"),
    ("viruses", "bacteria"), ("a lake", "a pond"),
    ("e-books", "printed books"), ("taking the train", "flying"),
    ("running", "swimming"), ("a laptop", "a desktop computer"),
    ("a savings account", "investing in stocks"), ("frogs", "toads"),
    ("alligators", "crocodiles"), ("baking soda", "baking powder"),
    ("a hurricane", "a tornado"), ("a simile", "a metaphor"),
    ("mitosis", "meiosis"), ("RAM", "disk storage"), ("HTTP", "HTTPS"),
    ("SQL databases", "NoSQL databases"), ("electric cars", "gasoline cars"),
    ("butter", "margarine"), ("a violin", "a viola"),
    ("rugby", "American football"), ("monkeys", "apes"),
    ("speed", "velocity"), ("weight", "mass"), ("a republic", "a monarchy"),
    ("working from home", "working in an office"),
    ("LED bulbs", "incandescent bulbs"), ("wool", "cotton"),
    ("hiking boots", "trail running shoes"), ("a credit card", "a debit card"),
    ("stocks", "bonds"), ("classical music", "jazz"),
    ("a novel", "a short story"), ("poetry", "prose"),
    ("a comet", "an asteroid"), ("a planet", "a star"),
    ("a moth", "a butterfly"), ("rice", "quinoa"), ("yoga", "pilates"),
    ("a podcast", "a radio show"), ("TCP", "UDP"),
    ("compiled languages", "interpreted languages"),
    ("git merge", "git rebase"), ("a city", "a town"),
    ("introverts", "extroverts"), ("an email", "a handwritten letter"),
    ("solar power", "wind power"), ("a microwave", "an oven"),
    ("a mountain vacation", "a beach vacation"),
    ("studying alone", "studying in a group"),
    ("bicycles", "electric scooters"), ("a marathon", "a half marathon"),
]
COMPARE_T = [
    "What is the difference between {} and {}?", "Compare {} and {}.",
    "What are the pros and cons of {} compared to {}?",
    "How are {} and {} similar, and how are they different?",
    "Make a short comparison table of {} and {}.",
    "Explain the main differences between {} and {} in a few bullet points.",
]


def build_compare(rng):
    return [[t.format(a, b) for a, b in PAIRS] for t in COMPARE_T]


# ---------------------------------------------------------------------------
# define
# ---------------------------------------------------------------------------

TERMS = [
    "serendipity", "inflation", "irony", "democracy", "an ecosystem",
    "procrastination", "a hypothesis", "gross domestic product", "empathy",
    "an algorithm", "nostalgia", "biodiversity", "a recession",
    "a budget deficit", "resilience", "a haiku", "an idiom", "a palindrome",
    "supply and demand", "a carbon footprint", "ambiguity", "a mortgage",
    "an interest rate", "a stereotype", "sarcasm", "an allergy",
    "a primary source", "alliteration", "meditation", "a renewable resource",
    "a constitution", "bias", "a placebo", "mindfulness", "a peninsula",
    "an archipelago", "a river delta", "the tundra", "an omnivore",
    "a mammal", "a prime number", "a fraction", "a variable in algebra",
    "a function in programming", "a noun", "an adverb", "a synonym",
    "a dividend", "a startup", "branding", "a deadline", "an introvert",
    "a fossil fuel", "humidity", "an electrical conductor", "a vertebrate",
    "a plot twist", "a protagonist", "a literary genre", "a web browser",
    "an operating system", "ephemeral", "ubiquitous", "meticulous",
    "pragmatic", "eloquent", "benevolent", "frugal", "candid", "diligent",
    "whimsical", "tenacious", "a tariff", "photosynthesis", "a metaphor",
]
DEFINE_T = [
    "Define {}.", "What does \"{b}\" mean?",
    "Give me a simple definition of {} and use it in a sentence.",
    "What is the meaning of the term \"{b}\"?",
    "Define {} in one sentence, then give an example.",
]


def build_define(rng):
    return [[t.format(w, b=bare(w)) for w in TERMS] for t in DEFINE_T]


# ---------------------------------------------------------------------------
# rewrite (tone/style changes and translation-like rewrites) and rephrase
# ---------------------------------------------------------------------------

SENTENCES = [
    "The meeting has been moved to Thursday afternoon.",
    "I can't come to the party because I have to work.",
    "Please send me the report by the end of the day.",
    "We are sorry for the delay in shipping your order.",
    "The new park will open next spring.",
    "Can you help me carry these boxes upstairs?",
    "I really enjoyed the dinner you made last night.",
    "The store is closed on public holidays.",
    "Our team finished the project ahead of schedule.",
    "It is going to rain all weekend.",
    "I think we should take a short break.",
    "The train was late, so I missed the start of the movie.",
    "Thank you for your help with the move.",
    "My phone battery dies very quickly.",
    "Let's meet at the café near the station at noon.",
    "The concert was louder than I expected.",
    "I forgot my keys at home this morning.",
    "The children played in the garden until sunset.",
    "This recipe needs two eggs and a cup of milk.",
    "We need more volunteers for the cleanup on Saturday.",
    "The museum is free for students on Fridays.",
    "I am looking for a quiet place to study.",
    "The printer on the second floor is broken again.",
    "He finally passed his driving test.", "The soup is too salty.",
    "Could you turn the music down a little?",
    "We went hiking and saw a deer near the river.",
    "The price of coffee has gone up this year.",
    "I'll call you when I get home.",
    "The library has a great collection of old maps.",
    "She is learning to play the guitar.",
    "The flight to Lisbon was cancelled because of fog.",
    "I don't understand the instructions.",
    "We should plant more trees in the neighborhood.",
    "The kids are excited about the school trip.",
    "Your package will arrive on Monday.",
    "The cake was delicious but a little dry.",
    "Everyone should drink more water.",
    "I'm not sure this plan will work.",
    "The hotel room had a beautiful view of the sea.",
]
REWRITE_T = [
    "Rewrite this sentence in a more formal tone: \"{}\"",
    "Make this sentence sound more casual: \"{}\"",
    "Rewrite this in very simple English: \"{}\"",
    "Translate this sentence into French: \"{}\"",
    "Translate into Spanish: \"{}\"",
    "How would you say this in German? \"{}\"",
    "Rewrite this sentence the way a pirate would say it: \"{}\"",
    "Make this sentence more polite: \"{}\"",
    "Rewrite this sentence so it sounds more exciting: \"{}\"",
]
REPHRASE_T = [
    "Rephrase this sentence: \"{}\"", "Say this another way: \"{}\"",
    "Paraphrase the following sentence: \"{}\"",
    "Give me three different ways to say: \"{}\"",
    "Reword this sentence without changing its meaning: \"{}\"",
]
BAD_GRAMMAR = [
    "me and him goes to the store every day.", "She don't like coffee.",
    "Their going to the beach tomorrow.", "I has finished my homework.",
    "The dogs is barking loud.", "We was late for the bus.",
    "Its a beautiful day, isnt it", "He runned to the park yesterday.",
    "Can you borrow me a pen?", "I seen that movie last week.",
    "There is many reasons to learn math.", "The informations are wrong.",
    "She sings very good.", "Me and my sister likes to bake.",
    "Who's book is this?", "I could of helped you.",
    "He don't know nothing about it.", "The team have win the game.",
    "Less people came than we expected.", "I am agree with you.",
]
GRAMMAR_T = [
    "Fix the grammar in this sentence: \"{}\"", "Correct this sentence: \"{}\"",
    "Is this sentence correct? If not, fix it: \"{}\"",
]


def build_rewrite(rng):
    return cross(REWRITE_T, SENTENCES, str.format)


def build_rephrase(rng):
    return cross(REPHRASE_T, SENTENCES, str.format) + cross(GRAMMAR_T, BAD_GRAMMAR, str.format)


# ---------------------------------------------------------------------------
# email / letters
# ---------------------------------------------------------------------------

EMAIL_PURPOSES = [
    "ask my manager for a day off next Friday",
    "thank a colleague for helping with a project",
    "apologize to a customer for a late delivery",
    "invite my neighbors to a garden party",
    "request a refund for a broken blender", "follow up after a job interview",
    "remind my team about tomorrow's meeting",
    "tell a teacher my child will be absent",
    "congratulate a friend on a new job",
    "ask a landlord to fix a leaking faucet",
    "decline a meeting invitation politely", "introduce myself to a new team",
    "ask a professor for a recommendation letter",
    "cancel a gym membership", "thank a host after a dinner party",
    "request more information about an apartment for rent",
    "invite a guest speaker to a school event",
    "tell a client that a project will be one week late",
    "welcome a new employee to the company",
    "ask for feedback on a presentation",
    "complain politely about noise from a neighbor's party",
    "confirm a hotel reservation",
    "ask a friend to return a borrowed book",
    "announce an office closure for a holiday",
    "resign from a job on good terms",
    "thank a customer for their first order",
    "ask a coworker to swap shifts", "invite family to a birthday dinner",
    "reschedule a doctor's appointment",
    "respond to a customer who received the wrong item",
    "request a meeting with a potential mentor",
    "thank volunteers after a charity event",
    "ask a city office about a parking permit",
    "share good news about a product launch with the team",
    "remind a client about an unpaid invoice",
    "ask my landlord whether pets are allowed",
    "wish a coworker a happy retirement",
    "apply for a summer internship",
    "ask a neighbor to water my plants while I'm away",
    "inform parents about a school field trip",
    "request time off for a family wedding",
    "thank a teacher at the end of the school year",
    "ask about a lost item at a train station",
    "invite a friend to go hiking on Saturday",
    "ask a supplier for a price quote",
]
EMAIL_T = [
    "Write an email to {}.", "Draft a short, polite email to {}.",
    "Help me write a message to {}.",
    "Write a friendly email to {}. Keep it under 100 words.",
    "Write a formal letter to {}.",
    "I need to {}. Can you write the email for me?",
]


def build_email(rng):
    return cross(EMAIL_T, EMAIL_PURPOSES, str.format)


BUILDERS = {
    "chat": build_chat, "explain": build_explain, "howto": build_howto,
    "advice": build_advice, "math": build_math, "reasoning": build_reasoning,
    "code": build_code, "summarize": build_summarize, "list": build_list,
    "creative": build_creative, "compare": build_compare,
    "define": build_define, "rewrite": build_rewrite,
    "rephrase": build_rephrase, "email": build_email,
}


# ---------------------------------------------------------------------------
# selection
# ---------------------------------------------------------------------------

def select(groups, quota, rng, seen):
    """Round-robin over shuffled template groups so no template dominates."""
    groups = [list(g) for g in groups if g]
    for g in groups:
        rng.shuffle(g)
    rng.shuffle(groups)
    picked = []
    pos = [0] * len(groups)
    while len(picked) < quota:
        progressed = False
        for gi, g in enumerate(groups):
            while pos[gi] < len(g):
                p = g[pos[gi]]
                pos[gi] += 1
                if p not in seen:
                    seen.add(p)
                    picked.append(p)
                    progressed = True
                    break
            if len(picked) >= quota:
                break
        if not progressed:
            raise RuntimeError("pool exhausted: only {} unique prompts".format(len(picked)))
    return picked


def generate(seed=SEED):
    rng = random.Random(seed)
    seen = set()
    records = []
    for cat, quota in QUOTAS:
        groups = BUILDERS[cat](rng)
        for p in select(groups, quota, rng, seen):
            records.append({"category": cat, "prompt": p})
    rng.shuffle(records)
    out = []
    for i, r in enumerate(records):
        out.append({"id": "train-{:05d}".format(i), "category": r["category"],
                    "prompt": r["prompt"]})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT, help="output JSONL path")
    args = ap.parse_args()
    recs = generate()
    with open(args.out, "w", encoding="utf-8") as fh:
        for r in recs:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    counts = {}
    for r in recs:
        counts[r["category"]] = counts.get(r["category"], 0) + 1
    print("wrote {} prompts to {}".format(len(recs), args.out))
    for cat, _ in QUOTAS:
        print("  {:<10s} {}".format(cat, counts.get(cat, 0)))


if __name__ == "__main__":
    main()
