"""Write ``corpus.txt``, the English-like text tailserve's tokenizers are trained on.

Generated, not downloaded: a few hundred lines of hand-written word lists and a small grammar
(stories, dialogue, notes about serving, numbers, dates, prices, bits of code, and some non-ASCII
text), with a fixed seed, so byte-level BPE learns realistic merges — common words whole, frequent
suffixes, digits, punctuation with spaces. The output ships as package data
(``src/tailserve/data/corpus.txt``, read by ``tailserve model init``); this development script
does not ship. Rerun it only to change the corpus:

    python tools/make_corpus.py [OUT]   # default: src/tailserve/data/corpus.txt

Past the style guide's ~300 lines on purpose: most of the file is the word lists themselves, and
the grammar reads best beside them.
"""

from __future__ import annotations

import random
from pathlib import Path


def _words(text: str) -> list[str]:
    return text.split()


NOUNS = _words(
    """
time year people way day man woman child world life hand part place case week company system
program question work government number night point home water room mother area money story fact
month lot right study book eye job word business issue side kind head house service friend father
power hour game line end member law car city community name president team minute idea kid body
information back parent face others level office door health person art war history party result
change morning reason research girl guy moment air teacher force education foot boy age policy
music market sense nation plan college interest death experience effect class control care field
development role effort rate heart drug show leader light voice wife police mind price report
decision son view relationship town road arm difference value building action model season society
tax director position player record paper space ground form event official matter center couple
site project activity star table need court oil situation cost industry figure street image phone
data picture practice piece land product doctor wall patient worker news test movie north love
support technology step baby computer type attention film tree source organization hair window
evidence population truth song energy machine garden river mountain island village forest bridge
kitchen letter window station train ship ocean lake field valley desert storm winter summer spring
autumn dinner breakfast lunch coffee bread cheese apple orange garden flower bird horse dog cat fish
request token scheduler server queue batch cache memory block engine kernel thread process packet
signal network latency throughput budget chunk prompt model layer tensor vector matrix gradient
weight cluster node replica worker client endpoint stream buffer counter metric trace sample policy
"""
)

VERBS = _words(
    """
ask build buy call carry change check choose clean close come count cover cross cut decide deliver
describe design discover draw drive eat enter explain fall feel fill find finish fix follow forget
give grow hear help hide hold hope join jump keep know laugh lead learn leave lend lift listen live
look lose love make measure meet move need notice offer open order paint pass pay pick place plan
play prepare print promise pull push reach read receive remember repair repeat reply report rest
return ride run save say see sell send serve share show sing sit sleep solve speak spend stand start
stay stop study suggest support take talk teach tell test think throw touch train travel try turn
understand use visit wait walk want wash watch win wish wonder work worry write schedule allocate
evict preempt compute measure sample decode encode stream batch cache restart deploy profile
"""
)

IRREGULAR_PAST = {
    "buy": "bought", "build": "built", "choose": "chose", "come": "came", "cut": "cut", "draw": "drew",
    "drive": "drove", "eat": "ate", "fall": "fell", "feel": "felt", "find": "found", "forget": "forgot",
    "give": "gave", "grow": "grew", "hear": "heard", "hide": "hid", "hold": "held", "keep": "kept",
    "know": "knew", "lead": "led", "leave": "left", "lend": "lent", "lose": "lost", "make": "made",
    "meet": "met", "pay": "paid", "read": "read", "ride": "rode", "run": "ran", "say": "said",
    "see": "saw", "sell": "sold", "send": "sent", "sing": "sang", "sit": "sat", "sleep": "slept",
    "speak": "spoke", "spend": "spent", "stand": "stood", "take": "took", "teach": "taught",
    "tell": "told", "think": "thought", "throw": "threw", "understand": "understood", "win": "won",
    "write": "wrote",
}  # fmt: skip

ADJECTIVES = _words(
    """
good new first last long great little own other old right big high different small large next early
young important few public bad same able late hard major better economic strong possible whole free
military true federal international full special easy clear recent certain personal open red
difficult available likely short single medical current wrong private past foreign fine common poor
natural significant similar hot dead central happy serious ready simple left physical general
environmental financial blue democratic dark various entire close legal religious cold final main
green nice huge popular traditional cultural quiet quick slow bright heavy light warm cool gentle
brave calm eager fair proud silent tired busy empty narrow wide deep shallow sharp soft smooth rough
rapid steady stable noisy idle hungry fast tiny random greedy chunked paged cached sorted
"""
)

ADVERBS = _words(
    """
quickly slowly carefully quietly suddenly finally usually often rarely always never sometimes
almost nearly already still soon today tomorrow yesterday again together alone really simply
clearly easily hardly exactly probably certainly perhaps gently loudly early later
"""
)

PREPOSITIONS = _words(
    "in on at near under over behind beside between through across along around after before during without with from into toward"
)
DETERMINERS = _words("the a the this that every each one another some no the")
PRONOUNS = _words("I you he she we they it")
CONJUNCTIONS = _words("and but so because while although when until unless")
SYLLABLES = _words(
    """
ka ri mo ta la ne so vi de ran tor mel bar fen gal hol jen kir lun mar nor pel quin ros sil
tam ul vor wen yar zel an el in on un ba be bo bu da do du fa fi fo ga ge go ha he hi ma me mi
na ni no pa pe po ra re ro sa se si ta te to va ve wa wi ya za ber dan ton ley wick ford ham
ash bel cor dra eth fin gor hal ith jor kel lor mir nav ost pra quo ril sto tev urn vel wyn xan
yor zan bri cla dre fro gri kra ple shu thra vex dol mun pir sav tul ard esk ind olm umb
"""
)
TITLES = _words("Dr. Mr. Ms. Prof. Capt.")
MONTHS = _words("January February March April May June July August September October November December")
WEEKDAYS = _words("Monday Tuesday Wednesday Thursday Friday Saturday Sunday")
UNITS = _words("ms s tokens requests GB MB KB km kg % GiB")

# Non-ASCII lines so multi-byte characters are seen (and merged) like any other text.
FOREIGN = [
    "Zoë ordered a café crème and a croissant at the brasserie.",
    "José and Inés visited São Paulo in the rainy season.",
    "The naïve façade of the old château hid a modern kitchen.",
    "Müller wrote about the Übergang from one régime to the next.",
    "Björn skied from Åre to Tromsø — about 400 km — in three days.",
    "Łukasz and Zuzana met in Kraków; the weather was grey.",
    "The price rose from €12.50 to £15.00, or about ¥2,400.",
    "안녕하세요. 오늘 서버의 p99 지연 시간이 다시 올라갔습니다.",
    "연속 배칭을 켰는데 왜 p99 TTFT가 여전히 튈까요?",
    "こんにちは、世界。今日は天気がいいですね。",
    "你好，世界。调度器决定每一步运行哪些请求。",
    "Привет, мир. Очередь запросов снова выросла.",
    "Γειά σου κόσμε. Η μνήμη της κρυφής μνήμης γέμισε.",
    "مرحبا بالعالم. الخادم يعمل الآن.",
    "The temperature fell to −5 °C, and the road was icy.",
    "She said “thank you” and left… quietly.",
    "Emoji in chat logs: 🙂 👍 🚀 ✅ ❤️ 🎉",
    "π ≈ 3.14159, √2 ≈ 1.41421, and ∑ of the series converges.",
    "Straße, Größe, Fußball — and the Eszett ß stays one letter.",
    "Ça va? Très bien, merci. À bientôt!",
]


def _past(verb: str) -> str:
    if verb in IRREGULAR_PAST:
        return IRREGULAR_PAST[verb]
    if verb.endswith("e"):
        return verb + "d"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ied"
    if len(verb) <= 4 and verb[-1] in "bgnpt" and verb[-2] in "aeiou" and verb[-3] not in "aeiou":
        return verb + verb[-1] + "ed"  # stop -> stopped, plan -> planned
    return verb + "ed"


def _third(verb: str) -> str:
    if verb.endswith(("s", "sh", "ch", "x", "o")):
        return verb + "es"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + "s"


def _plural(noun: str) -> str:
    irregular = {"man": "men", "woman": "women", "child": "children", "foot": "feet", "person": "people"}
    if noun in irregular:
        return irregular[noun]
    if noun.endswith(("s", "sh", "ch", "x")):
        return noun + "es"
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "s"


class Grammar:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def name(self) -> str:
        r = self.rng
        return "".join(r.choice(SYLLABLES) for _ in range(r.randint(2, 4))).capitalize()

    def noun_phrase(self) -> str:
        r = self.rng
        noun = r.choice(NOUNS)
        if r.random() < 0.15:
            return r.choice(["the ", "some ", "many ", "two ", "these "]) + _plural(noun)
        if r.random() < 0.2:
            return self.name()
        det = r.choice(DETERMINERS)
        adj = r.choice(ADJECTIVES) + " " if r.random() < 0.45 else ""
        if det == "a" and (adj or noun)[0] in "aeiou":
            det = "an"
        return f"{det} {adj}{noun}"

    def clause(self) -> str:
        r = self.rng
        subject = self.noun_phrase() if r.random() < 0.6 else r.choice(PRONOUNS)
        verb = r.choice(VERBS)
        form = r.random()
        if form < 0.5:
            verb_text = _past(verb)
        elif form < 0.75:
            verb_text = verb if subject in ("I", "you", "we", "they") else _third(verb)
        else:
            verb_text = r.choice(["will ", "can ", "should ", "did not ", "could "]) + verb
        parts = [subject, verb_text, self.noun_phrase()]
        if r.random() < 0.3:
            parts.insert(1, r.choice(ADVERBS))
        if r.random() < 0.5:
            parts.append(f"{r.choice(PREPOSITIONS)} {self.noun_phrase()}")
        return " ".join(parts)

    def sentence(self) -> str:
        r = self.rng
        text = self.clause()
        if r.random() < 0.3:
            text += f", {r.choice(CONJUNCTIONS)} {self.clause()}"
        text = text[0].upper() + text[1:]
        return text + r.choice([".", ".", ".", "!", "?", "."])

    def dialogue(self) -> str:
        r = self.rng
        speaker = f"{r.choice(TITLES)} {self.name()}" if r.random() < 0.3 else self.name()
        verb = r.choice(["said", "asked", "replied", "whispered", "shouted", "answered"])
        line = self.sentence()
        return f'"{line}" {verb} {speaker}.' if r.random() < 0.5 else f'{speaker} {verb}, "{line}"'

    def serving_note(self) -> str:
        r = self.rng
        metric = r.choice(["p50 TTFT", "p99 TTFT", "p99 ITL", "mean TPOT", "E2E latency", "queueing delay"])
        policy = r.choice(["vllm", "sglang", "tgi", "sarathi", "orca", "vllm-v0", "static"])
        templates = [
            f"With {policy} at {r.randint(1, 64)} requests/s, {metric} was {r.randint(5, 9000)} ms.",
            f"A {2 ** r.randint(7, 14)}-token prompt took {r.uniform(5, 900):.1f} ms to prefill on {r.choice(['A100', 'H100', 'H200', 'L40S'])}.",
            f"Set max_num_batched_tokens={2 ** r.randint(8, 14)} and max_num_seqs={2 ** r.randint(3, 9)}.",
            f"The KV cache held {r.randint(100, 90000):,} blocks of {r.choice([16, 32, 64])} tokens; {r.randint(0, 100)}% were in use.",
            f"Iteration {r.randint(1, 99999)}: {r.randint(0, 8192)} prefill tokens, {r.randint(0, 256)} decodes, {r.uniform(1, 120):.2f} ms.",
            f"Request {r.randint(1000, 999999)} was preempted {r.randint(1, 5)} times and finished after {r.uniform(0.1, 30):.2f} s.",
            f"{policy} served {r.randint(100, 5000):,} output tokens/s at a batch size of {r.randint(1, 256)}.",
        ]
        return r.choice(templates)

    def date_line(self) -> str:
        r = self.rng
        when = f"{r.choice(WEEKDAYS)}, {r.choice(MONTHS)} {r.randint(1, 28)}, {r.randint(1990, 2030)}"
        clock = f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d}"
        amount = f"${r.randint(1, 999)}.{r.randint(0, 99):02d}"
        value = f"{r.uniform(0, 1000):.1f} {r.choice(UNITS)}"
        return r.choice(
            [
                f"On {when} at {clock}, {self.name()} paid {amount} for {self.noun_phrase()}.",
                f"Meeting: {when}, {clock} - agenda: {self.noun_phrase()}, {self.noun_phrase()}.",
                f"Total: {amount} ({r.randint(1, 40)} items, {r.randint(0, 25)}% off); measured {value}.",
            ]
        )

    def code_line(self) -> str:
        r = self.rng
        a, b = r.choice(NOUNS), r.choice(NOUNS)
        return r.choice(
            [
                f"def {r.choice(VERBS)}_{a}(self, {b}_id: int) -> list[int]:",
                f"    for i in range(len({a}s)):",
                f"        {a}_{b} = {r.randint(0, 4096)} * {b}.num_{a}s + {r.randint(0, 9)}",
                f'    return {{"{a}": {r.randint(0, 99)}, "{b}": [{r.randint(0, 9)}, {r.randint(0, 9)}]}}',
                f"    if {a} is None or {b} >= {r.randint(1, 512)}:",
                f"{a.upper()}_{b.upper()} = {r.uniform(0, 1):.4f}  # {self.clause()}",
            ]
        )

    def roster(self) -> str:
        r = self.rng
        people = ", ".join(f"{self.name()} {self.name()}" for _ in range(r.randint(4, 10)))
        return f"{r.choice(['Residents of', 'Visitors to', 'Engineers in', 'Players from'])} {self.name()}: {people}."

    def paragraph(self) -> str:
        r = self.rng
        # kind -> weight: mostly prose, then the other registers a serving system's users type.
        kinds = {
            "prose": 40,
            "dialogue": 17,
            "serving": 12,
            "date": 9,
            "code": 9,
            "list": 3,
            "roster": 12,
            "foreign": 3,
        }
        kind = r.choices(list(kinds), weights=list(kinds.values()))[0]
        if kind == "prose":
            return " ".join(self.sentence() for _ in range(r.randint(2, 6)))
        if kind == "dialogue":
            return " ".join(self.dialogue() for _ in range(r.randint(1, 3)))
        if kind == "serving":
            return " ".join(self.serving_note() for _ in range(r.randint(1, 3)))
        if kind == "date":
            return self.date_line()
        if kind == "code":
            return "\n".join(self.code_line() for _ in range(r.randint(2, 5)))
        if kind == "list":
            return f"- {self.sentence()}\n- {self.sentence()}\n- {self.sentence()}"
        if kind == "roster":
            return self.roster()
        return r.choice(FOREIGN)


def write_corpus(path: Path, size_bytes: int = 450_000, seed: int = 0) -> None:
    grammar = Grammar(seed)
    paragraphs: list[str] = []
    total = 0
    while total < size_bytes:
        paragraph = grammar.paragraph()
        paragraphs.append(paragraph)
        total += len(paragraph.encode("utf-8")) + 2
    path.write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")


CORPUS = Path(__file__).resolve().parents[1] / "src" / "tailserve" / "data" / "corpus.txt"

if __name__ == "__main__":
    import sys

    write_corpus(Path(sys.argv[1]) if len(sys.argv) > 1 else CORPUS)
