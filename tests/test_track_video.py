"""CleanRL's conventions in both scripts: --track (Weights & Biases, offline here) and --capture-video."""

import glob
import json
import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor

import imageio.v2 as imageio
import numpy as np
import pytest
import torch
from wandb.proto import wandb_internal_pb2

from helpers import CARTPOLE_FLAGS as CARTPOLE
from helpers import error_line, run, scalars, train

SCRIPTS = ["impala_mono.py", "impala_poly.py"]
# Two Pong envs stepped in turn, 20 steps per update.
PONG = {
    "impala_mono.py": ["--num-actors", 1, "--num-envs-per-actor", 2, "--unroll-length", 10, "--batch-size", 2],
    "impala_poly.py": ["--num-envs", 2, "--env-batch-size", 2, "--num-threads", 1, "--unroll-length", 10, "--batch-size", 2],
}


def wandb_records(path):
    """The records of a .wandb file, read as W&B writes it: a 7-byte header, then LevelDB's log format (32 KiB blocks;
    each chunk: crc32, length, type (1 full, 2 first, 3 middle, 4 last)) around protobuf `Record`s."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    records, position, pending = [], 7, b""
    while position + 7 <= len(data):
        if 32768 - position % 32768 < 7:  # a block's tail too short for a chunk header is padding
            position += 32768 - position % 32768
            continue
        length, kind = struct.unpack("<HB", data[position + 4 : position + 7])
        chunk, position = data[position + 7 : position + 7 + length], position + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(pending))
    return records


def offline_run(path):
    """(run id, display name, project, config, [history rows]) of one offline W&B run file."""
    records = wandb_records(path)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    history = [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    return run.run_id, run.display_name, run.project, config, history


def track_then_resume(script, cwd):
    """A --track run of 80 steps, then --resume to 160: the scalars reach W&B, and the resumed run continues the same
    W&B run."""
    os.makedirs(cwd)
    run_dir = train(script, "CartPole-v1", 80, [*CARTPOLE[script], "--track"], cwd)
    (first,) = glob.glob(str(cwd / "wandb" / "offline-run-*" / "run-*.wandb"))
    run_id, name, project, config, history = offline_run(first)
    assert (name, project, config["env_id"], config["batch_size"]) == (os.path.basename(run_dir), "impala", "CartPole-v1", 4)
    logged = [(row["global_step"], row["losses/loss"]) for row in history if "losses/loss" in row]
    assert (
        logged == [(step, pytest.approx(value, rel=1e-6)) for step, value in scalars(run_dir, "losses/loss")]
        and len(logged) == 2
    )
    path = os.path.join(run_dir, "checkpoint.pt")
    assert torch.load(path, weights_only=True)["args"]["wandb_id"] == run_id

    result = run(
        script,
        "--env-id",
        "CartPole-v1",
        "--total-timesteps",
        160,
        *CARTPOLE[script],
        "--track",
        "--resume",
        path,
        cwd=cwd,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (second,) = set(glob.glob(str(cwd / "wandb" / "offline-run-*" / "run-*.wandb"))) - {first}
    resumed_id, _, _, _, history = offline_run(second)
    assert resumed_id == run_id
    assert [row["global_step"] for row in history if "losses/loss" in row] == [120, 160]


@pytest.mark.slow
def test_track_logs_the_scalars_and_a_resumed_run_continues_the_wandb_run(tmp_path, monkeypatch):
    """Both scripts side by side: W&B's tensorboard sync holds each run's end until about 10 s after its start, time in
    which the other script's run computes."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    with ThreadPoolExecutor(len(SCRIPTS)) as pool:
        flows = {script: pool.submit(track_then_resume, script, tmp_path / script) for script in SCRIPTS}
    for future in flows.values():
        future.result()  # a failed assertion is raised here, with its script's paths in the message


def check_video(path, version, game_return=None):
    """One recorded game: named update<version>-game<n>-return<R>-steps<L>.mp4, L + 1 full-colour 210x160 frames (the
    reset screen, then one per step); returns R."""
    match = re.fullmatch(rf"update{version}-game\d+-return(-?\d+)-steps(\d+)\.mp4", os.path.basename(path))
    assert match, path
    frames = np.stack(imageio.mimread(path, memtest=False))
    assert frames.shape == (int(match[2]) + 1, 210, 160, 3), frames.shape
    assert np.abs(frames[..., 0].astype(int) - frames[..., 2]).mean() > 10  # colour, not the grey observation
    assert -21 <= int(match[1]) <= 21 and game_return in (None, int(match[1]))
    return int(match[1])


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_capture_video_records_the_first_game_in_training_and_every_game_in_eval(tmp_path, script):
    """3000 steps of two envs: env 0 ends its first game (random Pong: 850-1300 steps) and starts more, of which none
    is recorded within the default 10 minutes. Then eval records its game, with the return it prints."""
    run_dir = train(script, "Pong-v5", 3000, [*PONG[script], "--capture-video"], tmp_path)
    videos = tmp_path / "videos" / os.path.basename(run_dir)
    (clip,) = glob.glob(str(videos / "*.mp4"))
    check_video(clip, version=r"\d+")

    checkpoint = os.path.join(run_dir, "checkpoint.pt")
    result = run(
        script,
        "--env-id",
        "Pong-v5",
        *PONG[script],
        "--eval-checkpoint",
        checkpoint,
        "--eval-episodes",
        1,
        "--capture-video",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    printed = float(result.stdout.strip().splitlines()[-1].split()[3])
    (eval_clip,) = set(glob.glob(str(videos / "*.mp4"))) - {clip}
    check_video(eval_clip, version=torch.load(checkpoint, weights_only=True)["num_updates"], game_return=printed)


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--env-id", "CartPole-v1", "--capture-video"],
            "error: --capture-video records Atari games; CartPole-v1 has no screen to record",
        ),
        (
            ["--env-id", "Pong-v5", "--capture-video", "--video-interval", 0],
            "error: --video-interval must be positive, got 0.0",
        ),
    ],
)
def test_bad_video_settings(tmp_path, script, flags, message):
    assert error_line(run(script, *flags, cwd=tmp_path)) == message
    assert not os.path.exists(tmp_path / "runs")
