"""Counting scenes drawn with PIL, standing in for the box's data when nothing can be downloaded.

Three conditions mirror the hidden test sets:
- "A": CLEVR-CoGenT condition A (train and val): cubes, cylinders and spheres on a plain floor, with the
  shape/color rule of `SHAPE_COLORS`;
- "B": condition B (the compositional test): the same renderer with the cube and cylinder colors swapped, so
  every cube and cylinder shows a shape/color pair that condition A never shows;
- "other": a different renderer (the SuperCLEVR-like test): other shapes and colors, textured or graded
  backgrounds, drop shadows, lighting shifts, a wide range of object sizes and light overlap.

`render_scene(seed, condition)` is a pure function of its arguments: the same seed gives byte-identical pixels and
the same `Scene`, whose `objects` list is the ground truth (the answer is always the number of objects drawn).
Shapes are drawn at twice the size and box-averaged down: cheap anti-aliasing without resampling ringing.
"""

from __future__ import annotations

import colorsys
import math
import random
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

RGB = tuple[int, int, int]

CONDITIONS = ("A", "B", "other")

# CLEVR's eight colors (its properties.json).
CLEVR_COLORS: dict[str, RGB] = {
    "gray": (87, 87, 87),
    "red": (173, 35, 35),
    "blue": (42, 75, 215),
    "green": (29, 105, 20),
    "brown": (129, 74, 25),
    "purple": (129, 38, 192),
    "cyan": (41, 208, 208),
    "yellow": (255, 238, 51),
}
_COLOR_SET_1 = ("gray", "blue", "brown", "yellow")
_COLOR_SET_2 = ("red", "green", "purple", "cyan")

# The attribute rule, in one table (CLEVR-CoGenT): the colors each shape may take under each condition.
# B swaps the cube and cylinder colors, so all of B's cubes and cylinders are combinations A never shows.
SHAPE_COLORS: dict[str, dict[str, tuple[str, ...]]] = {
    "A": {"cube": _COLOR_SET_1, "cylinder": _COLOR_SET_2, "sphere": tuple(CLEVR_COLORS)},
    "B": {"cube": _COLOR_SET_2, "cylinder": _COLOR_SET_1, "sphere": tuple(CLEVR_COLORS)},
}

# The "other" renderer's shapes and colors: none of them is a CLEVR shape or color.
OTHER_SHAPES = ("triangle", "star", "hexagon", "diamond", "pentagon", "cross")
OTHER_COLORS: dict[str, RGB] = {
    "orange": (245, 130, 20),
    "lime": (150, 220, 40),
    "teal": (0, 150, 140),
    "sky": (80, 170, 250),
    "magenta": (220, 40, 160),
    "pink": (250, 150, 190),
    "white": (245, 245, 245),
    "navy": (30, 40, 120),
    "crimson": (200, 20, 50),
    "gold": (240, 190, 30),
}

# CLEVR-like phrasings for A and B; SuperCLEVR-like ones for "other". Both always ask for all objects.
_CLEVR_QUESTIONS = (
    "How many items are there in the image?",
    "How many objects are there in the image?",
    "What number of objects are there in the image?",
)
_SUPERCLEVR_QUESTIONS = (
    "How many different items are there in the image?",
    "How many different objects are there in the image?",
    "How many things can you count in the image?",
)
QUESTIONS: dict[str, tuple[str, ...]] = {"A": _CLEVR_QUESTIONS, "B": _CLEVR_QUESTIONS, "other": _SUPERCLEVR_QUESTIONS}

MIN_IMAGE_SIDE = 32
_SUPERSAMPLE = 2

# Object sizes, as the half side of an object's bounding square over the image's shorter side.
_CLEVR_RADIUS = {"small": 0.055, "large": 0.085}
# "other" picks one regime per scene, so some scenes hold only tiny objects and others only big ones.
_OTHER_RADIUS_REGIMES = ((0.03, 0.05), (0.03, 0.13), (0.08, 0.14))

# Placement: random positions per object, then a restart with every object shrunk, until all fit.
_PLACEMENT_TRIES = 200
_LAYOUT_RESTARTS = 12
_SHRINK = 0.85
_MIN_RADIUS_PX = 3.0  # smaller objects stop being countable by eye
_CLEVR_GAP_PX = 3.0  # A/B objects never touch: each is one connected blob on the floor
_OTHER_OVERLAP = 0.15  # "other" bounding squares may overlap by this fraction of their summed half sides


@dataclass(frozen=True)
class SceneObject:
    shape: str
    color: str
    material: str  # "rubber" or "metal" in A/B, "flat" in "other"
    x: float  # center, output pixels
    y: float
    radius: float  # half side of the object's bounding square, output pixels
    angle: float = 0.0  # rotation in radians ("other" only)


@dataclass(frozen=True)
class Scene:
    condition: str
    question: str
    image_size: tuple[int, int]
    objects: tuple[SceneObject, ...]

    @property
    def count(self) -> int:
        return len(self.objects)


@dataclass(frozen=True)
class _Spec:
    """An object's attributes, fixed before placement so a layout restart does not change what is drawn."""

    shape: str
    color: str
    material: str
    radius: float
    angle: float
    perspective: bool  # CLEVR's camera: objects farther up the image look smaller


def render_scene(
    seed: int,
    condition: str,
    image_size: tuple[int, int] = (480, 320),
    count_range: tuple[int, int] = (1, 10),
) -> tuple[Image.Image, Scene]:
    """One RGB image and its description; the count is drawn uniformly from `count_range` (inclusive)."""
    if condition not in CONDITIONS:
        raise ValueError(f"condition must be one of {CONDITIONS}, got {condition!r}")
    width, height = check_render_args(image_size, count_range)
    rng = random.Random(seed)
    count = rng.randint(*count_range)
    question = rng.choice(QUESTIONS[condition])
    shorter = min(width, height)
    if condition == "other":
        specs = _other_specs(rng, count, shorter)
        objects = _place(rng, specs, width, height, gap=0.0, overlap=_OTHER_OVERLAP)
        image = _draw_other(rng, objects, width, height)
    else:
        specs = _clevr_specs(rng, condition, count, shorter)
        objects = _place(rng, specs, width, height, gap=_CLEVR_GAP_PX, overlap=0.0)
        image = _draw_clevr(rng, objects, width, height)
    return image, Scene(condition, question, (width, height), tuple(objects))


def check_render_args(image_size: tuple[int, int], count_range: tuple[int, int]) -> tuple[int, int]:
    """Raises ValueError on an image size or count range `render_scene` cannot honor; returns (width, height)."""
    width, height = image_size
    if min(width, height) < MIN_IMAGE_SIDE:
        raise ValueError(f"image_size must be at least {MIN_IMAGE_SIDE}x{MIN_IMAGE_SIDE}, got {width}x{height}")
    low, high = count_range
    if not 0 <= low <= high:
        raise ValueError(f"count_range must be (low, high) with 0 <= low <= high, got {count_range}")
    return int(width), int(height)


def _clevr_specs(rng: random.Random, condition: str, count: int, shorter: int) -> list[_Spec]:
    specs = []
    for _ in range(count):
        shape = rng.choice(tuple(SHAPE_COLORS[condition]))
        color = rng.choice(SHAPE_COLORS[condition][shape])
        material = rng.choice(("rubber", "metal"))
        radius = _CLEVR_RADIUS[rng.choice(("small", "large"))] * shorter
        specs.append(_Spec(shape, color, material, radius, 0.0, perspective=True))
    return specs


def _other_specs(rng: random.Random, count: int, shorter: int) -> list[_Spec]:
    low, high = rng.choice(_OTHER_RADIUS_REGIMES)
    return [
        _Spec(
            shape=rng.choice(OTHER_SHAPES),
            color=rng.choice(tuple(OTHER_COLORS)),
            material="flat",
            radius=rng.uniform(low, high) * shorter,
            angle=rng.uniform(0.0, 2 * math.pi),
            perspective=False,
        )
        for _ in range(count)
    ]


def _place(
    rng: random.Random, specs: list[_Spec], width: int, height: int, gap: float, overlap: float
) -> list[SceneObject]:
    """Positions for every spec, all inside the image; bounding squares keep `gap` pixels apart (or overlap at most
    `overlap`). Rejection sampling; when an object finds no room the whole layout restarts with smaller objects."""
    scale = 1.0
    for _ in range(_LAYOUT_RESTARTS):
        placed: list[SceneObject] = []
        for spec in specs:
            found = _try_place(rng, spec, scale, placed, width, height, gap, overlap)
            if found is None:
                break
            placed.append(found)
        else:
            return placed
        scale *= _SHRINK
    raise ValueError(
        f"cannot place {len(specs)} countable objects in a {width}x{height} image; "
        "use a larger image or a smaller count range"
    )


def _try_place(
    rng: random.Random,
    spec: _Spec,
    scale: float,
    placed: list[SceneObject],
    width: int,
    height: int,
    gap: float,
    overlap: float,
) -> SceneObject | None:
    for _ in range(_PLACEMENT_TRIES):
        y = rng.uniform(0, height)
        depth = 0.7 + 0.3 * y / height if spec.perspective else 1.0
        radius = max(_MIN_RADIUS_PX, spec.radius * scale * depth)
        if not radius + 1 <= y <= height - radius - 1 or width < 2 * radius + 2:
            continue
        x = rng.uniform(radius + 1, width - radius - 1)
        if all(
            max(abs(x - other.x), abs(y - other.y)) >= (radius + other.radius) * (1 - overlap) + gap
            for other in placed
        ):
            return SceneObject(spec.shape, spec.color, spec.material, x, y, radius, spec.angle)
    return None


def _mix(color: RGB, target: RGB, amount: float) -> RGB:
    return tuple(round(c + (t - c) * amount) for c, t in zip(color, target))  # type: ignore[return-value]


_WHITE: RGB = (255, 255, 255)
_BLACK: RGB = (0, 0, 0)


def _draw_clevr(rng: random.Random, objects: list[SceneObject], width: int, height: int) -> Image.Image:
    # A plain floor, so every object is one blob that differs from it (what the count test checks).
    floor = rng.randint(140, 165)
    canvas = Image.new("RGB", (width * _SUPERSAMPLE, height * _SUPERSAMPLE), (floor, floor, floor))
    draw = ImageDraw.Draw(canvas)
    for obj in objects:
        _CLEVR_PAINTERS[obj.shape](draw, obj)
    return canvas.reduce(_SUPERSAMPLE)


def _scaled(obj: SceneObject) -> tuple[float, float, float]:
    return obj.x * _SUPERSAMPLE, obj.y * _SUPERSAMPLE, obj.radius * _SUPERSAMPLE


def _paint_cube(draw: ImageDraw.ImageDraw, obj: SceneObject) -> None:
    cx, cy, r = _scaled(obj)
    base = CLEVR_COLORS[obj.color]
    depth = 0.35 * r  # the receding top and side faces
    left, top, right, bottom = cx - r, cy - r, cx + r, cy + r
    draw.rectangle((left, top + depth, right - depth, bottom), fill=base)
    draw.polygon(
        [(left, top + depth), (left + depth, top), (right, top), (right - depth, top + depth)],
        fill=_mix(base, _WHITE, 0.3),
    )
    draw.polygon(
        [(right - depth, top + depth), (right, top), (right, bottom - depth), (right - depth, bottom)],
        fill=_mix(base, _BLACK, 0.3),
    )
    if obj.material == "metal":
        _specular(draw, cx - 0.55 * r, cy - 0.2 * r, 0.15 * r, base)


def _paint_cylinder(draw: ImageDraw.ImageDraw, obj: SceneObject) -> None:
    cx, cy, r = _scaled(obj)
    base = CLEVR_COLORS[obj.color]
    half_width, cap = 0.85 * r, 0.3 * r  # cap: half height of the elliptic top and bottom
    draw.ellipse((cx - half_width, cy + r - 2 * cap, cx + half_width, cy + r), fill=base)
    draw.rectangle((cx - half_width, cy - r + cap, cx + half_width, cy + r - cap), fill=base)
    draw.ellipse((cx - half_width, cy - r, cx + half_width, cy - r + 2 * cap), fill=_mix(base, _WHITE, 0.3))
    if obj.material == "metal":
        stripe = (cx - 0.6 * half_width, cy - r + 2.2 * cap, cx - 0.4 * half_width, cy + r - 1.5 * cap)
        draw.rectangle(stripe, fill=_mix(base, _WHITE, 0.6))


def _paint_sphere(draw: ImageDraw.ImageDraw, obj: SceneObject) -> None:
    cx, cy, r = _scaled(obj)
    base = CLEVR_COLORS[obj.color]
    # A darker rim at the bottom right, lit from the top left.
    draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=_mix(base, _BLACK, 0.3))
    inner_x, inner_y, inner_r = cx - 0.1 * r, cy - 0.1 * r, 0.85 * r
    draw.ellipse((inner_x - inner_r, inner_y - inner_r, inner_x + inner_r, inner_y + inner_r), fill=base)
    if obj.material == "metal":
        _specular(draw, cx - 0.35 * r, cy - 0.35 * r, 0.2 * r, base)


def _specular(draw: ImageDraw.ImageDraw, x: float, y: float, radius: float, base: RGB) -> None:
    draw.ellipse((x - radius, y - radius, x + radius, y + radius), fill=_mix(base, _WHITE, 0.7))


_CLEVR_PAINTERS = {"cube": _paint_cube, "cylinder": _paint_cylinder, "sphere": _paint_sphere}


def _other_outline(obj: SceneObject) -> list[tuple[float, float]]:
    """The shape's polygon, inscribed in the circle of radius `obj.radius`, hence inside its bounding square."""
    cx, cy, r = _scaled(obj)
    if obj.shape == "star":
        polar = [(r if i % 2 == 0 else 0.45 * r, i * math.pi / 5) for i in range(10)]
    elif obj.shape == "diamond":
        polar = [(r, 0.0), (0.65 * r, math.pi / 2), (r, math.pi), (0.65 * r, 3 * math.pi / 2)]
    elif obj.shape == "cross":
        arm, half = 0.92 * r, 0.3 * r
        corners = [(half, arm), (half, half), (arm, half), (arm, -half), (half, -half), (half, -arm)]
        corners += [(-x, -y) for x, y in corners]
        polar = [(math.hypot(x, y), math.atan2(y, x)) for x, y in corners]
    else:
        sides = {"triangle": 3, "pentagon": 5, "hexagon": 6}[obj.shape]
        polar = [(r, i * 2 * math.pi / sides) for i in range(sides)]
    return [(cx + d * math.cos(a + obj.angle), cy + d * math.sin(a + obj.angle)) for d, a in polar]


def _luminance(color: RGB) -> float:
    return 0.299 * color[0] + 0.587 * color[1] + 0.114 * color[2]


def _draw_other(rng: random.Random, objects: list[SceneObject], width: int, height: int) -> Image.Image:
    noise = np.random.default_rng(rng.getrandbits(64))
    pixels = _background(rng, noise, width, height)
    big = (width * _SUPERSAMPLE, height * _SUPERSAMPLE)
    # Back to front, so a lower (nearer) object covers the one behind it where they overlap.
    ordered = sorted(objects, key=lambda obj: obj.y)
    outlines = [_other_outline(obj) for obj in ordered]

    if rng.random() < 0.7:  # drop shadows, cast away from one light for the whole scene
        light = rng.uniform(0.0, 2 * math.pi)
        shadow = Image.new("L", big, 0)
        shadow_draw = ImageDraw.Draw(shadow)
        for obj, outline in zip(ordered, outlines):
            offset = 0.3 * obj.radius * _SUPERSAMPLE
            dx, dy = offset * math.cos(light), offset * math.sin(light)
            shadow_draw.polygon([(x + dx, y + dy) for x, y in outline], fill=255)
        shadow = shadow.reduce(_SUPERSAMPLE).filter(ImageFilter.GaussianBlur(1.5))
        pixels *= 1.0 - rng.uniform(0.3, 0.5) * (np.asarray(shadow, dtype=np.float32)[..., None] / 255.0)

    # Colors on black plus a coverage mask, both box-averaged: the colors come out premultiplied by coverage, so
    # edges blend with the floor instead of darkening towards the black around the shapes.
    colors = Image.new("RGB", big, _BLACK)
    coverage = Image.new("L", big, 0)
    colors_draw, coverage_draw = ImageDraw.Draw(colors), ImageDraw.Draw(coverage)
    for obj, outline in zip(ordered, outlines):
        fill = OTHER_COLORS[obj.color]
        edge = _mix(fill, _BLACK, 0.55) if _luminance(fill) > 110 else _mix(fill, _WHITE, 0.55)
        edge_width = max(1, round(obj.radius * _SUPERSAMPLE / 6))
        colors_draw.polygon(outline, fill=fill, outline=edge, width=edge_width)
        coverage_draw.polygon(outline, fill=255, outline=255, width=edge_width)
    alpha = np.asarray(coverage.reduce(_SUPERSAMPLE), dtype=np.float32)[..., None] / 255.0
    pixels = pixels * (1.0 - alpha) + np.asarray(colors.reduce(_SUPERSAMPLE), dtype=np.float32)

    # Lighting: contrast and brightness shifts, and a shading ramp across the image in a random direction.
    mean = pixels.mean()
    pixels = (pixels - mean) * rng.uniform(0.75, 1.25) + mean
    pixels *= rng.uniform(0.8, 1.2) * _ramp(rng, width, height, rng.uniform(0.75, 1.0), rng.uniform(1.0, 1.1))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")


def _muted_color(rng: random.Random) -> np.ndarray:
    """A low-saturation background color, so the saturated objects stand out from it."""
    red, green, blue = colorsys.hsv_to_rgb(rng.random(), rng.uniform(0.05, 0.35), rng.uniform(0.3, 0.85))
    return np.array([red, green, blue], dtype=np.float32) * 255


def _ramp(rng: random.Random, width: int, height: int, start: float, end: float) -> np.ndarray:
    """An (H, W, 1) linear ramp from `start` to `end` along a random direction."""
    angle = rng.uniform(0.0, 2 * math.pi)
    xs = np.arange(width, dtype=np.float32)[None, :]
    ys = np.arange(height, dtype=np.float32)[:, None]
    along = xs * math.cos(angle) + ys * math.sin(angle)
    along = (along - along.min()) / max(float(along.max() - along.min()), 1.0)
    return (start + (end - start) * along)[..., None]


def _background(rng: random.Random, noise: np.random.Generator, width: int, height: int) -> np.ndarray:
    """An (H, W, 3) float32 floor: a solid color, a gradient between two colors, or a noise texture."""
    style = rng.choice(("solid", "gradient", "texture"))
    first = _muted_color(rng)
    if style == "solid":
        return np.broadcast_to(first, (height, width, 3)).copy()
    if style == "gradient":
        along = _ramp(rng, width, height, 0.0, 1.0)
        return first * (1 - along) + _muted_color(rng) * along
    # Blotches (low-frequency noise scaled up smoothly) plus grain; gray, so the hue stays the base color's.
    coarse = noise.normal(0.0, 18.0, size=(height // 16 + 2, width // 16 + 2)).astype(np.float32)
    blotches = np.asarray(Image.fromarray(coarse, "F").resize((width, height), Image.Resampling.BICUBIC))
    grain = noise.normal(0.0, 6.0, size=(height, width)).astype(np.float32)
    return first + (blotches + grain)[..., None]
