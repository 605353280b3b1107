"""scripts/shapes_adherence.py's merge (the sampling itself runs outside CI: 74 s a video at 128 x 128)."""
import json

from helpers import load_script


def test_adherence_script_keeps_the_objects_and_merges_what_each_shape_word_drew(tmp_path):
    """scripts/shapes_adherence.py --merge: per caption shape word, the shares of the classes drawn."""
    script = load_script("shapes_adherence")
    obj = dict(colour="red", direction="up", colour_score=1.0, shape_score=0.5, motion_score=1.0)
    sample = dict(seed=0, score=0.5, colour=1.0, shape=0.5, motion=0.0, seconds=1.0)
    records = [dict(sample, prompt=0, objects=[dict(obj, shape="square", drawn={"circle": 3, "square": 1})]),
               dict(sample, prompt=1),  # written before the objects were kept: left out
               dict(sample, prompt=2, objects=[dict(obj, shape="square", drawn={"triangle": 4}),
                                               dict(obj, shape="circle", drawn={"circle": 2})])]
    for r in records:
        (tmp_path / f"{r['prompt']:03d}_0.json").write_text(json.dumps(r))
    summary = script.main(["--out", str(tmp_path), "--merge"])
    assert summary["shape_drawn"] == {"circle": {"circle": 1.0, "square": 0.0, "triangle": 0.0},
                                      "square": {"circle": 0.375, "square": 0.125, "triangle": 0.5}}
