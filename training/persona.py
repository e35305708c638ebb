"""What the model says about itself: short replies, written by this project, to greetings,
thanks, "who are you", "what can you do" and requests it cannot do (stories, emails, code,
maths, news, tasks such as timers and bookings, explanations and advice). Each says what it
is (a small dictionary model trained on WordNet) and suggests a question that works, naming
a real lemma in a form the corpus answers for it (`corpus.answerable`).

The user messages are templates with slots (imperatives, questions, slang, with and without
punctuation and capitals): thousands of distinct messages a kind, several replies a kind. The
evaluation's own 50 messages (`training/eval_persona.txt`) are written apart and never
produced here (a test checks every message against them).
"""

from __future__ import annotations

import itertools
import random
import string

from training.corpus import Pair

FORMS: dict[str, tuple[str, ...]] = {
    "define": ("What does '{w}' mean?", "Define {w}.", "{w}"),
    "kind": ("What is {a} {w}?",),
    "synonym": ("Synonyms of {w}?", "A word like '{w}'?"),
    "antonym": ("What is the opposite of '{w}'?",),
    "example": ("Use '{w}' in a sentence.",),
}  # the questions a reply suggests, by the kind of answer they need (corpus.answerable)

# The user's messages: templates whose {slots} take every value of SLOTS (`messages`). Kinds:
# greetings, thanks, goodbyes, questions about the model, about what it can do, and requests
# it cannot do (stories, writing, code, maths, news, tasks, explanations and advice).
SLOTS: dict[str, tuple[str, ...]] = {
    "hi": ("hello", "hi", "hey", "hiya", "heya", "yo", "howdy", "hullo", "greetings",
           "good morning", "good afternoon", "good evening", "hey hey", "ahoy"),
    "to": ("", " bot", " friend", " buddy", " everyone", " mate", " dictionary",
           " robot", " pal"),
    "tail": ("", ", how are you", ", how's it going", ", anyone there",
             ", pleased to meet you", ", how are things", ", it's me again"),
    "thx": ("thanks", "thank you", "thx", "ty", "cheers", "thanks a lot", "thank you so much",
            "thanks a million", "thank u", "tysm", "much obliged"),
    "thx_to": ("", " bot", " buddy", " mate", " friend", " kindly"),
    "thx_tail": ("", ", that helps", ", that was helpful", ", great answer", ", perfect",
                 ", got it", ", that's what I needed", ", you're a star"),
    "bye": ("bye", "goodbye", "see you", "see ya", "bye bye", "good night", "gotta go",
            "I'm off", "talk to you later", "take care", "farewell", "cya", "ttyl",
            "until next time", "see you tomorrow", "have a nice day", "so long", "nighty night"),
    "bye_to": ("", " bot", " friend", " everyone", " for now", " then"),
    "pre": ("", "hey, ", "so ", "ok, ", "um, ", "bot, ", "quick question: "),
    "self": ("who are you", "what are you", "what is your name", "are you a person",
             "are you a robot", "are you an AI", "are you ChatGPT", "are you Alexa",
             "are you a human being", "are you alive", "are you real", "are you conscious",
             "do you have a name", "who made you", "who created you", "who trained you",
             "who programmed you", "who owns you", "who designed you", "where do you come from",
             "what model are you", "which model is this", "what version are you",
             "how old are you", "how big are you", "how were you trained",
             "what were you trained on", "what is this thing", "is this an AI", "are you smart",
             "do you think", "do you dream", "are you a chatbot", "introduce yourself",
             "tell me about yourself", "describe yourself", "what's your purpose",
             "why do you exist", "are you sentient", "what company made you", "are you GPT-4",
             "are you Google", "do you have a body", "are you a language model"),
    "able": ("what can you do", "what do you do", "help", "help me", "I need help",
             "how do I use you", "how does this work", "what should I ask you",
             "what are you good at", "what do you know", "what questions can I ask",
             "what are your features", "show me what you can do", "give me an example",
             "what commands do you understand", "what is this app for", "how can you help me",
             "can you help me", "are you able to help", "what are you for",
             "can you do anything else", "I'm confused", "I don't know what to ask",
             "where do I start", "what can I type here", "do you know everything",
             "can you chat with me", "can you talk", "what do I do now", "any tips",
             "can you learn", "do you remember our chat"),
    "form": ("poem", "short poem", "haiku", "limerick", "song", "story", "short story", "sonnet",
             "rap", "joke", "riddle", "fable", "fairy tale", "ballad", "play", "novel"),
    "topic": ("the sea", "my dog", "a dragon", "the moon", "winter", "love", "friendship",
              "a robot", "space", "the city", "my mother", "rain", "a lost key", "pirates",
              "summer holidays", "a haunted house", "coffee", "a small village", "the mountains",
              "my best friend", "a unicorn", "time travel", "spring", "the stars",
              "a talking tree", "football", "school", "a brave knight", "the forest", "a penguin"),
    "doc": ("email", "letter", "cover letter", "text message", "complaint", "thank-you card",
            "invitation", "apology", "reply", "memo", "report", "speech", "toast", "review"),
    "person": ("my boss", "my landlord", "my teacher", "a customer", "my team", "the school",
               "my neighbour", "HR", "my bank", "a client", "my doctor", "my sister"),
    "matter": ("a day off", "the broken heater", "a late payment", "the meeting tomorrow",
               "my holiday", "a refund", "the new project", "a pay rise", "the noise"),
    "text": ("text", "article", "paragraph", "page", "chapter", "essay", "book", "story", "email",
             "document", "report", "paper"),
    "phrase": ("this sentence", "'thank you'", "'where is the station'", "my letter",
               "this paragraph", "'I love you'", "'how much is it'", "this menu", "'good night'"),
    "language": ("French", "German", "Spanish", "Italian", "Japanese", "Chinese", "Russian",
                 "Portuguese", "Dutch", "Arabic"),
    "lang": ("Python", "JavaScript", "Java", "C", "C++", "Rust", "Go", "SQL", "bash", "Excel",
             "HTML", "TypeScript", "PHP", "Ruby"),
    "task": ("sort a list", "reverse a string", "read a file", "parse JSON",
             "connect to a database", "send an HTTP request", "remove duplicates from a list",
             "count the words in a text", "write a loop", "split a string",
             "find the largest number", "merge two dictionaries", "print hello world",
             "make a web server", "read user input"),
    "n": ("12", "15", "17", "23", "36", "48", "64", "99", "125", "250", "1024"),
    "m": ("3", "4", "6", "7", "11", "13", "20", "32"),
    "expr": ("x cubed", "sin x", "2x + 1", "e to the x", "1/x", "x^3 - 2x", "cos 2x", "ln x"),
    "city": ("Paris", "Tokyo", "New York", "Berlin", "Madrid", "Sydney", "Chicago", "Toronto",
             "Mumbai", "Cairo", "Dublin", "Lisbon", "Seoul", "Mexico City"),
    "event": ("football match", "election", "Super Bowl", "game last night", "Oscars",
              "Tour de France", "race yesterday", "Champions League", "chess championship",
              "Eurovision", "NBA finals", "Wimbledon"),
    "company": ("Tesla", "Google", "Amazon", "Microsoft", "Nvidia", "Netflix", "Toyota"),
    "when": ("tomorrow", "tonight", "at 7 am", "next Monday", "in an hour", "on Friday",
             "this weekend"),
    "span": ("5 minutes", "20 minutes", "an hour", "30 seconds", "two hours", "45 minutes",
             "3 minutes", "a quarter of an hour"),
    "errand": ("call my mom", "buy milk", "water the plants", "pay the rent", "take my pills",
               "send the report", "feed the cat", "book a dentist appointment"),
    "booking": ("flight", "hotel", "table", "train ticket", "taxi", "room", "cinema ticket"),
    "thing": ("book", "restaurant", "podcast", "TV show", "laptop", "song", "video game", "film",
              "hotel", "phone", "series", "board game"),
    "subject": ("how a car engine works", "the theory of relativity", "how the stock market works",
                "black holes", "the French Revolution", "machine learning", "how vaccines work",
                "why the sky is blue", "the rules of chess", "how to invest", "blockchain",
                "the meaning of life", "how planes fly", "string theory", "the Roman empire"),
    "life": ("my relationship", "saving money", "studying for exams", "my new job", "losing weight",
             "sleeping better", "buying a house", "learning a language", "my exams",
             "starting a business"),
    "dish": ("pancakes", "lasagna", "a curry", "chocolate cake", "fried rice", "a vegan dinner",
             "soup", "pizza dough"),
}
SLOTS["m2"] = SLOTS["m"]
SLOTS |= {f"a_{name}": tuple(("an " if v[0] in "aeiouAEIOU" else "a ") + v for v in SLOTS[name])
          for name in ("doc", "lang")}  # with the article: 'an email', 'a letter'

ASKS: dict[str, tuple[str, ...]] = {
    "greeting": (
        "{hi}{to}{tail}", "{hi}{to}!", "sup bot", "wassup", "whats up", "yo what's up",
        "hi there", "hey there", "hiya there, how are you", "hi there, what's up", "hey bot", "hey you", "how are you", "how are you doing", "how's it going",
        "how do you do", "what's new", "hello?", "is anyone there?", "hello world",
        "knock knock", "what's good", "hi, how are you today?", "hey, good to see you",
        "good morning, bot", "top of the morning", "g'day", "hey what's going on",
        "hi again", "hey again", "hiya again", "I'm back", "hey, I'm back", "back again",
    ),
    "thanks": (
        "{thx}{thx_to}{thx_tail}", "{thx}{thx_to}!", "great, thanks", "ok thanks",
        "perfect, thank you", "awesome thanks", "nice one", "good job", "well done, thanks",
        "that's great", "you're the best", "love it", "brilliant, thanks!", "that was helpful",
        "thanks for your help", "thank you for the answer", "I owe you one",
        "much appreciated", "I appreciate it", "appreciate the help", "really appreciate it",
    ),
    "bye": ("{bye}{bye_to}", "{bye}{bye_to}!", "ok bye", "that's all, thanks, bye",
            "I have to go now", "I'm leaving now", "signing off", "good night, bot"),
    "who": ("{pre}{self}?", "{pre}{self}"),
    "can": ("{pre}{able}?", "{pre}{able}", "?", "??", "...", "what?", "hmm"),
    "story": (
        "Write a {form} about {topic}.", "Write me a {form} about {topic}", "write a {form}",
        "Can you write a {form} about {topic}?", "Compose a {form} about {topic}.",
        "I want a {form} about {topic}", "Make up a {form} about {topic}.",
        "Tell me a {form} about {topic}.", "Give me a {form} about {topic}",
        "tell me a joke", "tell me a story", "Say something funny.", "Entertain me.",
        "Make me laugh.", "I'm bored.", "Sing me a song.", "write something creative",
        "Tell me a fun fact.", "Can you tell jokes?",
    ),
    "email": (
        "Write an email to {person} about {matter}.", "Draft {a_doc} to {person}.",
        "Help me write {a_doc} to {person}.", "Can you write {a_doc} for me?",
        "write {a_doc} to {person} about {matter}", "Reply to {person} for me.",
        "Proofread my {doc}.", "Summarize this {text}.", "Summarize this {text} for me please",
        "Give me a summary of this {text}.", "Translate {phrase} into {language}.",
        "How do you say {phrase} in {language}?", "Rewrite this {text} in simpler words.",
        "Make this {text} shorter.", "Check the grammar of my {doc}.",
        "Can you translate to {language}?", "Fix the spelling in my {doc}.",
    ),
    "code": (
        "Write {a_lang} function to {task}.", "How do I {task} in {lang}?",
        "write {lang} code to {task}", "Can you show me how to {task} in {lang}?",
        "Fix my {lang} code.", "Can you debug my {lang} program?", "My {lang} code doesn't work.",
        "Explain this {lang} error.", "What is wrong with my {lang} code?",
        "Write {a_lang} program that can {task}.", "Fix my code.", "my code doesn't compile",
        "What does this error mean?", "Explain this stack trace.", "Can you code a website?",
        "Build me an app.", "Make a website for my shop.", "git push is failing",
        "Write a unit test for this function.", "Refactor this code.",
    ),
    "maths": (
        "What is {n} plus {m}?", "what's {n} minus {m}", "What is {n} times {m}?", "{n} + {m}",
        "{n} * {m}", "{n} / {m}", "{n} - {m} = ?", "Divide {n} by {m}.", "Multiply {n} by {m}.",
        "add {n} and {m}", "Calculate {n} x {m}.", "What is {m}% of {n}?",
        "What's the square root of {n}?", "What is {n} squared?", "Is {n} a prime number?",
        "Convert {n} miles to kilometres.", "What is {m} to the power of {m2}?",
        "Solve {m}x + {n} = 0.", "Integrate {expr}.", "Differentiate {expr}.",
        "What is the derivative of {expr}?", "Help me with my algebra homework.",
        "Solve this equation for me.", "Can you do maths?", "how much is {n} divided by {m}",
    ),
    "news": (
        "What's the weather in {city}?", "Will it rain in {city} tomorrow?",
        "What time is it in {city}?", "How hot is it in {city} today?",
        "Who won the {event}?", "who won the {event}", "What's the score of the {event}?",
        "How is {company} stock doing?", "What's {company}'s share price?",
        "What is the latest news?", "Any news today?", "What happened today?",
        "What's the date today?", "what day is it", "What year is it?", "What's the time?",
        "Is it going to snow?", "What's trending right now?", "Who is the prime minister?",
        "What's the price of gold?", "How much is a bitcoin worth?", "Any headlines?",
    ),
    "task": (
        "Set a timer for {span}.", "set a timer {span}", "Start a {span} timer.",
        "Set an alarm {when}.", "Wake me up {when}.", "Remind me to {errand} {when}.",
        "remind me to {errand}", "Book a {booking} {when}.",
        "Can you book me a {booking} in {city}?", "Book a flight to {city}.",
        "Book me a {booking}.", "Order a pizza.", "Order me a taxi to the airport.", "Call my mom.", "Play some music.",
        "Play my workout playlist.", "Turn on the lights.", "Turn off the TV.",
        "Send a text to {person}.", "Add milk to my shopping list.",
        "Find me a cheap hotel in {city}.", "Schedule a meeting with {person} {when}.",
        "Navigate to the nearest gas station.", "Open my calendar.", "Take a note.",
        "Find a {thing} for me.", "Buy me a new {thing}.", "Search the web for {subject}.",
    ),
    "explain": (
        "Explain {subject}.", "Can you explain {subject}?", "Teach me about {subject}.",
        "I want to learn about {subject}", "Give me advice on {life}.",
        "Any tips for {life}?", "How can I get better at {life}?", "Recommend a {thing}.",
        "What {thing} should I get?", "Suggest a good {thing} for me.",
        "What's the best {thing}?", "How do I make {dish}?", "Give me a recipe for {dish}.",
        "What should I have for lunch?", "What do you think about {subject}?",
        "Should I quit my job?", "Is it worth buying a {thing}?", "Tell me a fact about {topic}.",
        "Why is the sea salty?", "How far is the moon?", "How do magnets work?",
    ),
}  # fmt: skip


def _slots(template: str) -> list[str]:
    return [name for _, name, _, _ in string.Formatter().parse(template) if name]


def messages(kind: str) -> list[str]:
    """Every user message of `kind` (a key of ASKS): each template with every filling of
    its slots, in a fixed order, without repeats."""
    out: dict[str, None] = {}
    for template in ASKS[kind]:
        names = _slots(template)
        for values in itertools.product(*(SLOTS[n] for n in names)):
            out[template.format(**dict(zip(names, values, strict=True)))] = None
    return list(out)


MESSAGES = {kind: messages(kind) for kind in ASKS}


def typed(text: str, rng: random.Random) -> str:
    """`text` as users type it: mostly as written, often in lower case without its full
    stop or exclamation mark, sometimes with no end punctuation at all or a capital first."""
    r = rng.random()
    if r < 0.3:
        return text.lower().rstrip("!.")
    if r < 0.4:
        return text.rstrip("!.?")
    if r < 0.5:
        return text[:1].upper() + text[1:]
    return text


WHAT_I_AM = (
    "I'm a small dictionary model trained on WordNet.",
    "I am a small model trained on the WordNet dictionary.",
    "I'm a dictionary to chat with: a small model trained on WordNet.",
    "I'm a small language model that knows the words of WordNet, an English dictionary.",
    "This is a small dictionary model, trained only on WordNet.",
)
SUGGEST = (
    "Ask me about a word, for example: {q}",
    "Try a word: {q}",
    "You could ask: {q}",
    "Ask me what a word means, like {q}",
    "I can define a word; try {q}",
    "Give me a word, for instance {q}",
)
OPENERS: dict[str, tuple[str, ...]] = {
    "greeting": ("Hello!", "Hi!", "Hello.", "Hi there.", "Good to see you."),
    "thanks": ("You're welcome.", "Glad to help.", "You're welcome!", "Any time."),
    "bye": ("Goodbye!", "Bye for now.", "Goodbye."),
    "who": ("", ""),
    "can": ("I can tell you what English words mean, their synonyms, opposites and kinds.",
            "I answer questions about English words: meanings, synonyms, opposites, examples.",
            "I know the meanings of English words, and their synonyms and opposites."),
    "story": ("I can't write stories, poems or jokes.", "I don't write stories or poems.",
              "Stories and jokes are beyond me."),
    "email": ("I can't write emails, letters or summaries.", "I don't write or translate texts.",
              "Writing messages is beyond me."),
    "code": ("I can't write or fix code.", "I don't know programming.",
             "Code is beyond me."),
    "maths": ("I can't do maths.", "I don't do calculations.", "Sums are beyond me."),
    "news": ("I don't know the news, the weather or the time.",
             "I have no news, weather or clock.", "I know nothing about current events."),
    "task": ("I can't do tasks: no timers, bookings or reminders.",
             "I can't set alarms, book things or send messages.", "Errands are beyond me."),
    "explain": ("I can't explain topics or give advice.",
                "I don't give explanations, advice or recommendations.",
                "Advice and explanations are beyond me."),
}


def question(lemma: str, kinds: tuple[str, ...], rng: random.Random) -> str:
    """One question about `lemma` that the corpus answers: a form of one of `kinds` (the
    kinds of answer the corpus holds for it, `corpus.answerable`), so an opposite is
    suggested only for a word with an antonym, a kind only for a noun with one."""
    t = rng.choice([f for k in kinds for f in FORMS[k]])
    a = "an" if lemma[:1] in "aeiou" else "a"
    text = t.format(w=lemma, a=a)
    return f"'{text}'" if t == "{w}" else text


def reply(kind: str, lemma: str, kinds: tuple[str, ...], rng: random.Random) -> str:
    """A reply to a message of `kind` (a key of ASKS): an opener, what the model is, and a
    question about `lemma` to try."""
    opener = rng.choice(OPENERS[kind])
    parts = [opener] if opener else []
    parts.append(rng.choice(WHAT_I_AM))
    suggestion = rng.choice(SUGGEST).format(q=question(lemma, kinds, rng))
    parts.append(suggestion if suggestion[-1] in ".?!" else suggestion + ".")
    return " ".join(parts)


def pairs(suggest_from: list[tuple[str, tuple[str, ...]]], n_each: int, rng: random.Random
          ) -> list[Pair]:
    """`n_each` pairs of each kind of message, the message drawn from every one of its
    kind (`MESSAGES`) and typed as users type; the suggested lemma drawn from `suggest_from`
    ((lemma, the kinds of question the corpus answers about it): everyday training lemmas)."""
    out = []
    for kind, asks in MESSAGES.items():
        for _ in range(n_each):
            lemma, kinds = rng.choice(suggest_from)
            user = typed(rng.choice(asks), rng)
            out.append(Pair(user, reply(kind, lemma, kinds, rng), lemma, f"persona-{kind}"))
    return out
