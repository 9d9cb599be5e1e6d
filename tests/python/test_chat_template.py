"""kvstack's chat templates against two references.

1. The default model's own tokenizer.chat_template (SmolLM2, ChatML with a
   default system message) rendered by Jinja2 the way Hugging Face does
   (sandboxed, trim_blocks + lstrip_blocks), vs kvstack_chat_render
   --template-file (family detection + default extraction + rendering).
2. llama.cpp's built-in renderer (llama_chat_apply_template via
   llama-cpp-python) for chatml, llama3, gemma and mistral-v1, vs
   kvstack_chat_render --kind. llama.cpp leaves BOS to the tokenizer; kvstack
   writes it in the text, so the reference is bos_text + llama.cpp's output.

Env: KVSTACK_BUILD_DIR (build tree holding src/tokenizer/tools/kvstack_chat_render)
or KVSTACK_CHAT_RENDER (the tool itself), KVSTACK_MODEL (GGUF path).
"""

import ctypes
import os
import subprocess

import pytest

from conftest import BUILD_DIR, MODEL

TOOL = os.environ.get("KVSTACK_CHAT_RENDER",
                      str(BUILD_DIR / "src" / "tokenizer" / "tools" / "kvstack_chat_render"))

SYSTEM = ("system", "You are terse.\nAnswer in one line.")
CONVERSATIONS = [
    [("user", "Hello!")],
    [SYSTEM, ("user", "What is the capital of France?")],
    [("user", "Hi"), ("assistant", "Hello! How can I help?"), ("user", "Tell me a joke.")],
    [SYSTEM, ("user", "  padded  "), ("assistant", "ok\n"), ("user", "multi\nline\n\ncontent")],
    [("user", "naïve café — 東京 🙂"), ("assistant", "{\"json\": [1, 2]}"), ("user", "<b>x</b>")],
    [SYSTEM, ("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d")],
]


def render_tool(args, messages, gen):
    cmd = [TOOL] + args + (["--gen"] if gen else [])
    for role, content in messages:
        cmd += [role, content]
    out = subprocess.run(cmd, capture_output=True, check=False)
    assert out.returncode == 0, out.stderr.decode()
    return out.stdout.decode("utf-8")


@pytest.fixture(scope="module", autouse=True)
def tool_exists():
    if not os.path.exists(TOOL):
        pytest.fail(f"{TOOL} not built (cmake --build <dir> --target kvstack_chat_render)")


@pytest.fixture(scope="module")
def smollm_template(tmp_path_factory):
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(MODEL)
    source = reader.fields["tokenizer.chat_template"].contents()
    path = tmp_path_factory.mktemp("tmpl") / "smollm2.jinja"
    path.write_bytes(source.encode("utf-8"))
    return source, str(path)


def jinja_render(source, messages, gen):
    jinja2 = pytest.importorskip("jinja2")
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source).render(
        messages=[{"role": r, "content": c} for r, c in messages],
        add_generation_prompt=gen, bos_token="<|im_start|>", eos_token="<|im_end|>")


def test_detects_model_template(smollm_template):
    _, path = smollm_template
    out = subprocess.run([TOOL, "--template-file", path, "--detect"], capture_output=True)
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout.decode() == "chatml"


@pytest.mark.parametrize("gen", [False, True])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_smollm2_template_matches_jinja(smollm_template, conv, gen):
    source, path = smollm_template
    messages = CONVERSATIONS[conv]
    want = jinja_render(source, messages, gen)
    got = render_tool(["--template-file", path], messages, gen)
    assert got == want


def llama_cpp_render(name, messages, gen):
    llama_cpp = pytest.importorskip("llama_cpp")
    arr = (llama_cpp.llama_chat_message * len(messages))()
    keep = []
    for i, (role, content) in enumerate(messages):
        keep += [role.encode(), content.encode()]
        arr[i].role = keep[-2]
        arr[i].content = keep[-1]
    size = 1 << 16
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_chat_apply_template(name.encode(), arr, len(messages), gen, buf, size)
    assert 0 <= n < size, f"llama_chat_apply_template({name}) returned {n}"
    return buf.raw[:n].decode("utf-8")


FAMILIES = [("chatml", "chatml", ""), ("llama3", "llama3", "<|begin_of_text|>"),
            ("gemma", "gemma", "<bos>"), ("mistral", "mistral-v1", "<s>")]


@pytest.mark.parametrize("gen", [False, True])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("kind,llama_name,bos", FAMILIES)
def test_family_matches_llama_cpp(kind, llama_name, bos, conv, gen):
    messages = CONVERSATIONS[conv]
    want = bos + llama_cpp_render(llama_name, messages, gen)
    got = render_tool(["--kind", kind], messages, gen)
    assert got == want


def test_errors_are_reported(smollm_template):
    out = subprocess.run([TOOL, "--kind", "vicuna", "user", "x"], capture_output=True)
    assert out.returncode == 1
    assert b"known: chatml, llama3, mistral, gemma" in out.stderr
    out = subprocess.run([TOOL, "--kind", "gemma", "user", "a", "user", "b"], capture_output=True)
    assert out.returncode == 1
    assert b"expected role 'assistant'" in out.stderr
