"""Training text for the built-in tiny model's byte-level BPE tokenizer.

The text is original and deliberately mixed: English prose, Python and shell code, JSON,
numbers and dates, French, German, Spanish, Greek, Russian, Chinese, Japanese, Korean,
emoji and mathematical symbols.  The non-Latin parts make the trained vocabulary contain
merges that span multi-byte UTF-8 characters (and tokens holding only part of one), which the
detokenizer tests rely on.

Changing this text changes the tokenizer, so bump ``MODEL_VERSION`` in ``tiny_model`` with it.
"""

from __future__ import annotations

_ENGLISH = r"""
The lighthouse keeper woke before dawn, as she had every morning for thirty years. She climbed
the spiral stairs, one hundred and twelve of them, and wiped the salt from the great lens. The
sea was grey and quiet, the wind was light from the west, and the fishing boats were already
leaving the harbour. She wrote the time, the weather and the state of the lamp in her logbook,
then made coffee and watched the gulls circle over the rocks.

A small language model does not understand the world; it predicts the next token from the
tokens before it. Even so, the predictions can be surprisingly useful. The model reads a prompt,
builds a cache of keys and values for every layer, and then generates one token at a time. The
first phase is called prefill and the second phase is called decode. Prefill is limited by
compute, because every prompt token is processed at once; decode is limited by memory bandwidth,
because each step reads the whole cache and all of the weights to produce a single token.

Disaggregated serving runs the two phases on different machines. A prefill node computes the
cache for the prompt and sends it to a decode node, which continues the generation. The proxy in
front of them chooses a pair of nodes for each request, forwards the prompt, and streams the
generated text back to the client. When a node fails, the proxy retries the request elsewhere,
and the blocks that held the failed request's cache are returned to the free pool.

It was the best of plans and the worst of plans. The engineers argued for a week about whether
the scheduler should prefer short requests or old ones. In the end they measured both, wrote the
numbers on the whiteboard, and chose the simpler rule: first come, first served, with a budget
of tokens per step so that no single request could starve the others.

Good tests are small, fast and precise. They say what they check, they fail for one reason, and
they leave the system as they found it. A test that sleeps for a second to wait for a server is
a test that will one day fail on a slow machine; a test that waits for an explicit signal will
not. When a bug is found, the first step is to write a test that shows it; the second step is to
fix it; the third is to ask why no earlier test caught it.

The river bends twice before it reaches the town. In spring it floods the lower meadows, and the
children float paper boats from the old stone bridge. In summer the water is low and clear, and
you can see the trout holding still in the current, facing upstream, waiting for insects. In
autumn the leaves turn the surface red and gold. In winter, some years, it freezes at the edges.

Questions people ask: What time is it? Where is the station? How much does this cost? Could you
help me, please? Why does the sky look blue? Who wrote this book? Which way is north? When does
the shop open? Is it going to rain tomorrow? Can I pay by card? Thank you very much! You're
welcome. Don't mention it. It's fine. I'm sure they'll arrive soon; we've waited long enough.

Recipe for bread: mix 500 g of flour, 350 ml of warm water, 10 g of salt and 5 g of yeast. Knead
for ten minutes, until the dough is smooth and elastic. Leave it to rise for an hour, shape it,
let it rise again for forty minutes, and bake at 230 degrees for thirty-five minutes. Let it
cool before cutting, or the crumb will be gummy.

The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How
vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow. The five boxing wizards
jump quickly. Jackdaws love my big sphinx of quartz.

Memory is organised in fixed-size blocks. Each sequence owns a list of block numbers, its block
table, and the attention kernel follows that table to find the keys and values of earlier
tokens. When two requests share a prefix, they can share the blocks that hold it, as long as
nobody writes to a shared block; a reference count records how many sequences use each block,
and a block returns to the free list only when its count drops to zero.
Dear Sam, thank you for your letter and for the photographs of the garden. The roses look
wonderful this year; you must have spent many evenings pruning them. We are all well here. The
children started school last week and already complain about homework, which I take as a good
sign. Your uncle has finally repaired the roof, so the kitchen no longer leaks when it rains.
Write soon and tell us when you plan to visit. With love, Anna.

Release notes, version 2.3.0. New: streaming responses now include token counts. Changed: the
default timeout is ten seconds instead of thirty. Fixed: a race between cancellation and
completion could leak a cache block; a crash when the prompt was empty; wrong error codes for
requests that exceeded the maximum length. Deprecated: the old configuration format will be
removed in version 3.0. Thanks to everyone who reported issues and sent patches.

The old map showed a path through the forest, past a ruined mill and across a narrow bridge. We
followed it for hours. The trees grew closer together, the light turned green, and the only
sounds were our footsteps and the distant knocking of a woodpecker. At last the path opened
onto a clearing, and there, exactly where the map said it would be, stood a small wooden hut
with smoke rising from its chimney.

Step 1: install the package. Step 2: run the server with the default model. Step 3: send a
request and check that the answer arrives. If the server does not start, read the log: the
most common causes are a port that is already in use, a missing model directory, and not
enough memory for the cache. Each error message names the setting to change.

Once upon a time there was a clockmaker who built a clock that ran backwards. People laughed at
it, then they grew curious, and then they began to visit the shop just to watch it. The
clockmaker said that the clock reminded him that every hour could be lived again in memory.
He never sold it, and when he died his daughter kept it in the window, still running backwards.
"""

_CODE = r"""
def fibonacci(n: int) -> list[int]:
    '''Return the first n Fibonacci numbers.'''
    result = []
    a, b = 0, 1
    for _ in range(n):
        result.append(a)
        a, b = b, a + b
    return result


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks))
        self.ref_count = [0] * num_blocks

    def allocate(self) -> int:
        if not self.free:
            raise RuntimeError("out of blocks")
        block = self.free.pop()
        self.ref_count[block] = 1
        return block

    def release(self, block: int) -> None:
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.free.append(block)


async def handle(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    prompt = body.get("prompt", "")
    max_tokens = int(body.get("max_tokens", 16))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    async for text in engine.generate(prompt, max_tokens=max_tokens):
        await response.write(f"data: {json.dumps({'text': text})}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    return response


for i in range(10):
    if i % 2 == 0:
        print(f"{i} is even")
    else:
        print(f"{i} is odd")

x = torch.randn(4, 8, dtype=torch.float32)
y = x @ x.T + torch.eye(4)
assert y.shape == (4, 4), y.shape
logits = model(input_ids)[:, -1, :]
next_token = torch.argmax(logits, dim=-1)

import os
import sys
from pathlib import Path

path = Path(os.environ.get("HOME", "/tmp")) / ".cache" / "data.json"
with open(path, "w", encoding="utf-8") as f:
    json.dump({"name": "example", "values": [1, 2, 3]}, f, indent=2)

#include <stdio.h>
int main(int argc, char **argv) {
    for (int i = 0; i < argc; ++i) {
        printf("%d: %s\n", i, argv[i]);
    }
    return 0;
}

fn main() {
    let words = vec!["alpha", "beta", "gamma"];
    for (i, w) in words.iter().enumerate() {
        println!("{}: {}", i, w);
    }
}

$ git status && git diff --stat
$ python -m pytest tests/ -q -x
$ curl -s http://127.0.0.1:8000/v1/completions -d '{"model": "tiny", "prompt": "Hi"}'
$ ls -la /var/log | grep -v total | sort -k5 -n | tail -n 3

SELECT name, COUNT(*) AS n FROM requests WHERE status = 'done' GROUP BY name ORDER BY n DESC;

{"id": "cmpl-42", "object": "text_completion", "created": 1700000000,
 "choices": [{"index": 0, "text": " world", "finish_reason": "length"}],
 "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}

<html><head><title>Status</title></head><body><p class="ok">All systems normal.</p></body></html>
def tokenize(text: str, vocab: dict[str, int]) -> list[int]:
    ids: list[int] = []
    for word in text.split():
        if word in vocab:
            ids.append(vocab[word])
        else:
            ids.extend(vocab.get(ch, 0) for ch in word)
    return ids


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    x = x - x.max(dim=dim, keepdim=True).values
    e = torch.exp(x)
    return e / e.sum(dim=dim, keepdim=True)


try:
    result = await asyncio.wait_for(queue.get(), timeout=5.0)
except asyncio.TimeoutError:
    log.warning("no result after %s seconds", 5.0)
    result = None
finally:
    queue.task_done()

const items = [1, 2, 3].map((x) => x * 2).filter((x) => x > 2);
console.log(`items: ${items.join(", ")}`);
"""

_NUMBERS = r"""
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 30 40 50 60 70 80 90 100
128 256 512 1024 2048 4096 8192 16384 32768 65536 1000000 3.14159 2.71828 1.41421 0.5 0.25
2024-01-15 2023-12-31 1999-07-04 12:30:45 08:00 23:59:59 +33 1 23 45 67 89 (555) 010-2368
$19.99 EUR 42,50 GBP 7.25 100% 50% 3/4 1/2 10^6 1e-5 6.02e23 -273.15 C 98.6 F #1 #2 #42
Order 7731: 3 x widget @ 4.50 = 13.50; 2 x gadget @ 11.25 = 22.50; total 36.00 (tax incl.)
Table: id=1 score=0.93 | id=2 score=0.87 | id=3 score=0.71 | id=4 score=0.64 | id=5 score=0.12
"""

_FRENCH = r"""
Le petit café au coin de la rue ouvre à sept heures. Les habitués arrivent tôt : un facteur
pressé, une étudiante qui révise ses cours, un vieil homme qui lit le journal en entier. La
serveuse connaît leurs commandes par cœur — un crème, un thé à la menthe, un café très serré.
Où est la gare, s'il vous plaît ? C'est à deux pas d'ici, après l'église, à gauche. Voilà !
L'été dernier, nous sommes allés en Bretagne. Il a plu presque tous les jours, mais les crêpes
étaient délicieuses et la mer était magnifique. Ça valait vraiment le détour, n'est-ce pas ?
Élève, être, naïf, Noël, garçon, français, déjà, très, où, hôtel, forêt, théâtre, œuvre.
"""

_GERMAN = r"""
Der Zug nach München fährt um halb neun vom Gleis drei ab. Die Fahrgäste drängen sich auf dem
Bahnsteig, und ein Schaffner ruft die Verspätung aus: etwa fünfzehn Minuten, wegen einer Störung
im Stellwerk. Über die Lautsprecher hört man Entschuldigungen; niemand ist wirklich überrascht.
Größe, Straße, Mädchen, schön, Brücke, Übung, Äpfel, Öl, heißen, müssen, Grüße aus Köln!
Wir möchten gerne zwei Stück Käsekuchen und eine große Tasse Kaffee, bitte. Danke schön.
Die Würde des Menschen ist unantastbar. Sie zu achten und zu schützen ist Verpflichtung aller.
"""

_SPANISH = r"""
¿Dónde está la biblioteca? ¡Qué día tan bonito! El niño jugó en el jardín hasta la noche.
Mañana iremos a la montaña con mis compañeros; llevaremos pan, queso, aceitunas y agua.
La canción más famosa del verano sonaba en todas las radios, desde Málaga hasta Bilbao.
"""

_GREEK = r"""
Καλημέρα! Τι κάνεις; Είμαι καλά, ευχαριστώ. Η Αθήνα είναι η πρωτεύουσα της Ελλάδας.
Ο ήλιος λάμπει πάνω από τη θάλασσα και τα καράβια φεύγουν από το λιμάνι του Πειραιά.
Αλφα, βήτα, γάμμα, δέλτα, έψιλον, ζήτα, ήτα, θήτα, ιώτα, κάππα, λάμδα, μι, νι, ξι, όμικρον.
Σε ένα μικρό χωριό ζούσε ένας ψαράς που κάθε πρωί έβγαινε στη θάλασσα με τη βάρκα του.
α + β = γ, π ≈ 3,14, Δx → 0, Σ x_i, λόγος, φιλοσοφία, δημοκρατία, μάθημα, ιστορία.
"""

_RUSSIAN = r"""
Привет! Как дела? Спасибо, всё хорошо. Москва — столица России, а Нева течёт через Петербург.
Утром в деревне было тихо: только петух кричал во дворе и где-то далеко лаяла собака.
Мы пошли в лес за грибами и нашли много белых, подберёзовиков и лисичек. Вечером бабушка
сварила суп, и мы долго сидели за столом, пили чай с вареньем и слушали её рассказы.
Съешь же ещё этих мягких французских булок, да выпей чаю. Это предложение содержит все буквы.
Программа читает файл, считает слова и выводит результат на экран. Ошибка: файл не найден.
Один, два, три, четыре, пять, шесть, семь, восемь, девять, десять. Здравствуйте, друзья!
"""

_CHINESE = r"""
今天天气很好，我们去公园散步吧。
春天来了，花开了，小鸟在树上唱歌。
我喜欢读书，也喜欢写字和画画。
这个模型很小，但是它可以生成文字。
请问，火车站在哪里？一直往前走，然后左转。
中国有很长的历史和丰富的文化。
他每天早上六点起床，先跑步，再吃早饭。
学习一门新的语言需要时间和耐心。
人工智能正在改变我们的生活和工作方式。
北京、上海、广州和深圳都是大城市。
一二三四五六七八九十，百千万亿。
我们的服务器把请求分成预填充和解码两个阶段。
妈妈在厨房里做饭，爸爸在客厅里看报纸。
这本书写得非常好，我已经读了三遍了。
中文的句子里没有空格，所以分词很重要。
你好！谢谢！对不起！没关系！再见！
"""

_JAPANESE = r"""
こんにちは。今日はいい天気ですね。
私は毎朝コーヒーを飲みながら新聞を読みます。
東京駅から新幹線に乗って京都へ行きました。
桜の季節になると、公園は花見の人でいっぱいになります。
ありがとうございます。どういたしまして。
このプログラムはテキストをトークンに分割します。
ひらがな、カタカナ、漢字を組み合わせて書きます。
猫が窓のそばで昼寝をしている。
雨が降ってきたので、傘を買いにコンビニへ行った。
日本語の勉強は難しいけれど、とても面白いです。
サーバーが応答しません。もう一度お試しください。
"""

_KOREAN = r"""
안녕하세요! 만나서 반갑습니다. 오늘 날씨가 정말 좋네요.
저는 서울에 살고 있고, 주말에는 한강 공원에서 자전거를 탑니다.
감사합니다. 괜찮아요. 다음에 또 만나요!
"""

_SYMBOLS = r"""
Emoji: 😀 😂 🙂 😉 😍 🤔 😴 👍 👋 🙏 🎉 🎂 🚀 🌍 🌧️ ☀️ ❤️ 💡 🔥 ✅ ❌ ⭐ 🐍 🦀 🍕 ☕
Family: 👨‍👩‍👧‍👦 flags: 🇫🇷 🇩🇪 🇯🇵 🇨🇳 skin tones: 👍🏻 👍🏽 👍🏿 keycaps: 1️⃣ 2️⃣ #️⃣
Great job 🎉🎉🎉! See you soon 👋😀. I love pizza 🍕 and coffee ☕☕.
Math: ∀x ∈ ℝ, x² ≥ 0; ∑ᵢ aᵢ = ∫₀¹ f(x) dx; √2 ≈ 1.414; ∞ ≠ −∞; A ⊆ B ∪ C; ¬(p ∧ q) ⇔ ¬p ∨ ¬q
Arrows and marks: → ← ↑ ↓ ⇒ • · … — – « » “quoted” ‘single’ © ® ™ § ¶ ° ± × ÷ µ ‰ € £ ¥ ₹
Combining: e\u0301 vs é, n\u0303 vs ñ, a̐ ḁ̈ q̣̇ — Zalgo-ish: ḩ̷e̴l̶l̵o̸
Box: ┌──┬──┐ │ab│cd│ └──┴──┘ ░▒▓█ ■□▲△●○◆◇
"""

CORPUS: str = "\n".join(
    [
        _ENGLISH,
        _CODE,
        _NUMBERS,
        _FRENCH,
        _GERMAN,
        _SPANISH,
        _GREEK,
        _RUSSIAN,
        _CHINESE,
        _JAPANESE,
        _KOREAN,
        _SYMBOLS,
        # The same material again, so that frequent multi-byte pieces reach merge frequency.
        _CHINESE,
        _JAPANESE,
        _RUSSIAN,
        _GREEK,
        _SYMBOLS,
        "\tindented with a tab\r\nwindows line ending\u00a0no-break space\u200bzero width\n",
    ]
)
