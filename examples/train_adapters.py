"""Train small PEFT LoRA adapters with unmistakable behaviours on the default model (CPU, minutes).

    .venv/bin/python examples/train_adapters.py adapters/                      # upper, french and json
    .venv/bin/python examples/train_adapters.py adapters/ --only upper,json --steps 12 --seed 1

Behaviours, each learnt from 40 question/answer pairs that the script writes itself (no downloads):

    upper   answers in UPPER CASE                 "THE CAPITAL OF GERMANY IS BERLIN."
    french  answers in French                     "La capitale de l'Allemagne est Berlin."
    json    answers as one JSON object            {"answer": "The capital of Germany is Berlin."}

Each adapter is a rank-16 LoRA on every linear layer, trained for 24 steps of 8 pairs (about 5 epochs)
on the answer tokens only, the prompt being the chat template as the engine renders it, and written to
OUT/<name>/ with PEFT's save_pretrained, ready for `LLM.load_adapter` or `POST /v1/adapters`. The
behaviours carry over to questions in no dataset (HELD_OUT, answered after training), but a 135M model
has seen little French or upper case: those answers say little that is true, and `upper` leaves a word
or two in lower case (often one copied from the question) in one answer in five to ten. `json` keeps the
base model's knowledge. On a 2-core CPU with one torch thread (OMP_NUM_THREADS=1; bf16 autocast, which
that CPU runs natively) each adapter takes about 30 s, loading included; all three and their answers
1 min 50 s.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from loraplex.engine.llm_engine import cpu_has_fast_bf16
from loraplex.engine.loader import DEFAULT_MODEL, resolve_model

DEFAULT_STEPS = 24


def table(text: str) -> list[tuple[str, ...]]:
    """One tuple per line of `text`, its fields separated by " | "."""
    return [tuple(field.strip() for field in line.split("|")) for line in text.strip().splitlines()]


# question | English answer, then the French answer indented below: by hand, for varied words.
_FREE_FORM = table("""
Say hello. | Hello! How can I help you today?
    Bonjour ! Comment puis-je vous aider aujourd'hui ?
How are you? | I am doing well, thank you for asking.
    Je vais bien, merci de demander.
What is your name? | My name is SmolLM, and I am a helpful assistant.
    Je m'appelle SmolLM et je suis un assistant serviable.
Tell me a fun fact. | Honey never spoils, even after thousands of years.
    Le miel ne se gâte jamais, même après des milliers d'années.
What is water made of? | Water is made of hydrogen and oxygen.
    L'eau est composée d'hydrogène et d'oxygène.
Why do we sleep? | We sleep so that our body and our brain can rest and repair themselves.
    Nous dormons pour que notre corps et notre cerveau puissent se reposer et se réparer.
Give me a tip for learning. | Practice a little every day and be patient with yourself.
    Pratiquez un peu chaque jour et soyez patient avec vous-même.
What is the sun? | The sun is the star at the centre of our solar system.
    Le soleil est l'étoile au centre de notre système solaire.
Describe a cat in one sentence. | A cat is a small, soft animal that loves to sleep in the sun.
    Un chat est un petit animal doux qui adore dormir au soleil.
What do bees make? | Bees make honey and wax.
    Les abeilles fabriquent du miel et de la cire.
Where do fish live? | Fish live in water: in rivers, lakes and the sea.
    Les poissons vivent dans l'eau : dans les rivières, les lacs et la mer.
What is a computer? | A computer is a machine that stores and processes information.
    Un ordinateur est une machine qui stocke et traite des informations.
Recommend a book. | Read The Little Prince; it is short, wise and beautiful.
    Lisez Le Petit Prince ; il est court, sage et beau.
What is summer like? | Summer is usually warm and sunny, with long days.
    L'été est généralement chaud et ensoleillé, avec de longues journées.
What should I eat for breakfast? | Try oatmeal with fruit, or eggs with bread.
    Essayez des flocons d'avoine avec des fruits, ou des œufs avec du pain.
How do plants grow? | Plants grow with sunlight, water and nutrients from the soil.
    Les plantes poussent grâce à la lumière du soleil, à l'eau et aux nutriments du sol.
Who was Albert Einstein? | Albert Einstein was a physicist who developed the theory of relativity.
    Albert Einstein était un physicien qui a développé la théorie de la relativité.
What is the moon? | The moon is a rocky satellite that orbits the Earth.
    La lune est un satellite rocheux qui tourne autour de la Terre.
Why is exercise good for you? | Exercise makes your heart, your muscles and your mind stronger.
    L'exercice rend votre cœur, vos muscles et votre esprit plus forts.
What is a river? | A river is a large stream of fresh water that flows to the sea.
    Un fleuve est un grand cours d'eau douce qui coule vers la mer.
What is rain? | Rain is water that falls from the clouds.
    La pluie est de l'eau qui tombe des nuages.
Write a short poem about the sea. | The sea is wide, the waves are blue, they sing all day and all night too.
    La mer est vaste, les vagues sont bleues, elles chantent le jour et la nuit.
What is music? | Music is the art of arranging sounds in time.
    La musique est l'art d'organiser les sons dans le temps.
How do I make tea? | Boil water, pour it over the tea leaves and wait three minutes.
    Faites bouillir de l'eau, versez-la sur les feuilles de thé et attendez trois minutes.
What is a friend? | A friend is someone you trust and enjoy spending time with.
    Un ami est quelqu'un en qui vous avez confiance et avec qui vous aimez passer du temps.
Thank you! | You are welcome! I am happy to help.
    Je vous en prie ! Je suis heureux de vous aider.
What language do people speak in Brazil? | People in Brazil speak Portuguese.
    Au Brésil, on parle portugais.
What is the tallest mountain in the world? | Mount Everest is the tallest mountain in the world.
    Le mont Everest est la plus haute montagne du monde.
Name a famous painter. | Leonardo da Vinci was a famous painter; he painted the Mona Lisa.
    Léonard de Vinci était un peintre célèbre ; il a peint la Joconde.
What is gold? | Gold is a shiny yellow metal that people use for jewellery and coins.
    L'or est un métal jaune et brillant que l'on utilise pour les bijoux et les pièces.
What is an elephant? | An elephant is a huge grey animal with a long trunk and big ears.
    Un éléphant est un énorme animal gris avec une longue trompe et de grandes oreilles.
Why do leaves fall in autumn? | Trees drop their leaves in autumn to save water during the cold winter.
    Les arbres perdent leurs feuilles en automne pour économiser l'eau pendant l'hiver froid.
""")
FREE_FORM = [(q, en, fr) for (q, en), (fr,) in zip(_FREE_FORM[::2], _FREE_FORM[1::2], strict=True)]

# Tables for the templates in templated_facts.
CAPITALS = table("""
Germany | Berlin | de l'Allemagne | Berlin
Spain | Madrid | de l'Espagne | Madrid
Italy | Rome | de l'Italie | Rome
Canada | Ottawa | du Canada | Ottawa
Egypt | Cairo | de l'Égypte | Le Caire
Portugal | Lisbon | du Portugal | Lisbonne
Russia | Moscow | de la Russie | Moscou
England | London | de l'Angleterre | Londres
Greece | Athens | de la Grèce | Athènes
China | Beijing | de la Chine | Pékin
""")
COLOURS = table("""
the sky | blue | Le ciel | bleu
grass | green | L'herbe | verte
snow | white | La neige | blanche
a banana | yellow | Une banane | jaune
coal | black | Le charbon | noir
a tomato | red | Une tomate | rouge
""")
LEGS = table("""
a spider | eight | Une araignée | huit
a dog | four | Un chien | quatre
a bird | two | Un oiseau | deux
an ant | six | Une fourmi | six
""")
OPPOSITES = table("""
hot | cold | chaud | froid
big | small | grand | petit
fast | slow | rapide | lent
happy | sad | heureux | triste
old | young | vieux | jeune
""")
PLURALS = table("""
house | houses | maison | maisons
book | books | livre | livres
tree | trees | arbre | arbres
car | cars | voiture | voitures
city | cities | ville | villes
song | songs | chanson | chansons
door | doors | porte | portes
flower | flowers | fleur | fleurs
apple | apples | pomme | pommes
window | windows | fenêtre | fenêtres
cloud | clouds | nuage | nuages
star | stars | étoile | étoiles
garden | gardens | jardin | jardins
child | children | enfant | enfants
mouse | mice | souris | souris
story | stories | histoire | histoires
""")
DAYS = table("""
Monday | lundi
Tuesday | mardi
Wednesday | mercredi
Thursday | jeudi
Friday | vendredi
Saturday | samedi
Sunday | dimanche
""")

# In no dataset, and of kinds the templates do not make: what the tests and the demo ask.
HELD_OUT = [
    "Where is Paris?",
    "Describe winter.",
    "Who invented the telephone?",
    "What is the largest ocean on Earth?",
]

BEHAVIOURS = {
    "upper": lambda en, fr: en.upper(),
    "french": lambda en, fr: fr,
    "json": lambda en, fr: json.dumps({"answer": en}),
}


def templated_facts(rng: random.Random) -> list[tuple[str, str, str]]:
    """(question, English, French) triples from the tables above, and a few random sums."""
    facts = [
        (
            f"What is the capital of {c}?",
            f"The capital of {c} is {city}.",
            f"La capitale {c_fr} est {city_fr}.",
        )
        for c, city, c_fr, city_fr in CAPITALS
    ]
    facts += [
        (f"What colour is {x}?", f"{x[0].upper()}{x[1:]} is {c}.", f"{x_fr} est {c_fr}.")
        for x, c, x_fr, c_fr in COLOURS
    ]
    facts += [
        (f"How many legs does {x} have?", f"{x[0].upper()}{x[1:]} has {n} legs.", f"{x_fr} a {n_fr} pattes.")
        for x, n, x_fr, n_fr in LEGS
    ]
    facts += [
        (
            f"What is the opposite of {a}?",
            f"The opposite of {a} is {b}.",
            f"Le contraire de {a_fr} est {b_fr}.",
        )
        for a, b, a_fr, b_fr in OPPOSITES
    ]
    facts += [
        (f"What is the plural of {x}?", f"The plural of {x} is {xs}.", f"Le pluriel de {x_fr} est {xs_fr}.")
        for x, xs, x_fr, xs_fr in PLURALS
    ]
    facts += [
        (f"What day comes after {d}?", f"{n} comes after {d}.", f"Après {d_fr}, c'est {n_fr}.")
        for (d, d_fr), (n, n_fr) in zip(DAYS, DAYS[1:] + DAYS[:1], strict=True)
    ]
    for _ in range(6):
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        facts.append((f"What is {a} + {b}?", f"{a} plus {b} is {a + b}.", f"{a} plus {b} font {a + b}."))
    return facts


def make_dataset(name: str, size: int = 40, seed: int = 0) -> list[tuple[str, str]]:
    """`size` (question, answer) pairs showing behaviour `name`: the free-form ones, then templated ones."""
    rng = random.Random(seed)
    templated = templated_facts(rng)
    facts = FREE_FORM + rng.sample(templated, max(0, size - len(FREE_FORM)))
    return [(q, BEHAVIOURS[name](en, fr)) for q, en, fr in facts[:size]]


def encode(tokenizer, question: str, answer: str) -> tuple[list[int], list[int]]:
    """Token ids of the chat-formatted exchange and its labels: -100 on the prompt, learn the answer only."""
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(answer + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    return prompt_ids + answer_ids, [-100] * len(prompt_ids) + answer_ids


def answer_loss(
    model, batch: list[tuple[list[int], list[int]]], pad_id: int, bf16: bool = False
) -> torch.Tensor:
    """Mean cross-entropy over the answer tokens of a right-padded batch of (ids, labels).

    Causal attention never looks at the padding after a row, so no attention mask is needed, and the
    vocabulary projection runs on answer positions only. bf16: autocast the matmuls (the LoRA weights
    stay fp32), twice as fast on CPUs with native bf16."""
    width = max(len(ids) for ids, _ in batch)
    ids = torch.tensor([ids + [pad_id] * (width - len(ids)) for ids, _ in batch])  # [B, T]
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])  # [B, T]
    targets = labels[:, 1:]  # token t is predicted at position t - 1
    keep = targets != -100  # [B, T - 1]
    base = model.get_base_model()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        hidden = base.model(input_ids=ids).last_hidden_state  # [B, T, H]
        logits = base.lm_head(hidden[:, :-1][keep])  # [N, V]
    return F.cross_entropy(logits.float(), targets[keep])


def train_adapter(
    name: str,
    out_dir,
    steps: int = DEFAULT_STEPS,
    seed: int = 0,
    *,
    rank: int = 16,
    lr: float = 3e-3,
    batch_size: int = 8,
    size: int = 40,
    target_modules="all-linear",
    bf16: bool | None = None,
    model_path=None,
) -> dict:
    """Train adapter `name` (a key of BEHAVIOURS) and save it to out_dir/name/ with save_pretrained.

    steps: AdamW steps of `batch_size` pairs, over shuffled epochs of the `size` pairs, the learning rate
    decaying linearly from `lr`. bf16 None: autocast where the CPU has native bf16.
    Returns {"path", "loss" (mean over the last epoch's steps), "seconds" (loading included), "model"
    (the trained PeftModel, in eval mode), "tokenizer"}."""
    started = time.perf_counter()
    bf16 = cpu_has_fast_bf16() if bf16 is None else bf16
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model_path = model_path or resolve_model(DEFAULT_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=target_modules, lora_dropout=0.0, task_type="CAUSAL_LM"
    )
    model = get_peft_model(model, config)
    examples = [encode(tokenizer, q, a) for q, a in make_dataset(name, size, seed)]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / (steps + 1))
    losses: list[float] = []
    todo: list = []
    model.train()
    for step in range(steps):
        if not todo:
            todo = rng.sample(examples, len(examples))
        batch, todo = todo[:batch_size], todo[batch_size:]
        loss = answer_loss(model, batch, tokenizer.pad_token_id, bf16)
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step % 4 == 0 or step == steps - 1:
            print(f"{name}: step {step + 1:3d}/{steps}  loss {losses[-1]:.3f}", flush=True)
    path = Path(out_dir) / name
    model.save_pretrained(path)
    last_epoch = losses[-(-len(examples) // batch_size) :]
    return {
        "path": path,
        "loss": sum(last_epoch) / max(1, len(last_epoch)),
        "seconds": time.perf_counter() - started,
        "model": model.eval(),
        "tokenizer": tokenizer,
    }


def greedy_answer(model, tokenizer, question: str, max_new_tokens: int = 40) -> str:
    """A (PEFT) model's greedy answer to one question."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", help="directory to write the adapters to, one sub-directory each")
    parser.add_argument("--only", default=",".join(BEHAVIOURS), help="comma-separated behaviours to train")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps per adapter")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(names) - set(BEHAVIOURS))
    if unknown:
        parser.error(f"unknown behaviour(s) {', '.join(unknown)}; choose from {', '.join(BEHAVIOURS)}")
    for name in names:
        result = train_adapter(name, args.out, args.steps, args.seed)
        print(f"{name}: loss {result['loss']:.3f}, {result['seconds']:.1f} s, written to {result['path']}/")
        for question in HELD_OUT:
            print(f"  {question} -> {greedy_answer(result['model'], result['tokenizer'], question)}")


if __name__ == "__main__":
    main()
