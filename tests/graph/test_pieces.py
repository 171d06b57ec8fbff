"""The pieces' states (digenrl/graph/pieces.py), driven directly: each iteration's and
version's transitions, the futures each state holds and hands back, and the error of
every transition from a state it does not start from."""

import pytest

from digenrl.graph.pieces import (Checkpoint, IllegalTransition, IterationPieces, Pieces,
                                  Stage, Weights)
from digenrl.graph.retention import Retention
from digenrl.graph.structure import GraphLayout


def test_an_iteration_goes_through_its_pieces_handing_back_what_each_held():
    it = IterationPieces(3)
    assert it.stage is Stage.PLANNED
    it.rollout_in({"decode": "d"}, {"latent": "l"})
    assert (it.stage, it.held) == (Stage.ROLLOUT, {"latent": "l"})
    assert it.train_in({"advantage": "a"}, {"root": "r"}) == ["l"]
    assert (it.stage, it.held) == (Stage.TRAIN, {"root": "r"})
    it.add_evals({"eval": "e"})
    assert it.tail_in({"stats": "s"}) == ["r"]
    assert (it.stage, it.held) == (Stage.TAIL, {})
    assert it.collect() == {"decode": "d", "advantage": "a", "stats": "s", "eval": "e"}
    assert (it.stage, it.outputs, it.evals) == (Stage.COLLECTED, {}, {})


@pytest.mark.parametrize("moves,message", [
    (["train"], "iteration 3: cannot move to 'train' in state 'planned' (expected 'rollout')"),
    (["tail"], "cannot move to 'tail' in state 'planned' (expected 'train')"),
    (["rollout", "rollout"], "cannot move to 'rollout' in state 'rollout' (expected 'planned')"),
    (["rollout", "collect"], "cannot move to 'collected' in state 'rollout' (expected 'tail')"),
    (["rollout", "train", "tail", "collect", "evals"],
     "iteration 3: cannot add evaluations in state 'collected'"),
    (["rollout", "train", "tail", "collect", "collect"],
     "cannot move to 'collected' in state 'collected' (expected 'tail')"),
])
def test_an_iteration_refuses_a_piece_out_of_order(moves, message):
    it = IterationPieces(3)
    do = {"rollout": lambda: it.rollout_in({}, {}), "train": lambda: it.train_in({}, {}),
          "tail": lambda: it.tail_in({}), "collect": it.collect,
          "evals": lambda: it.add_evals({"e": 1})}
    for move in moves[:-1]:
        do[move]()
    stage = it.stage
    with pytest.raises(IllegalTransition, match=message.replace("(", r"\(").replace(")", r"\)")):
        do[moves[-1]]()
    assert it.stage is stage  # a refused move changes nothing


def test_a_version_made_and_checkpointed_is_published_written_and_released():
    pieces = Pieces()
    rec = pieces.made(2, "weights", state="state", checkpoint="writing")
    assert (rec.weights, rec.checkpoint) == (Weights.PUBLISHED, Checkpoint.WRITING)
    assert pieces.is_published(2) and pieces.writing() == [rec]
    assert rec.take_state() == "state"
    with pytest.raises(IllegalTransition, match="version 2: no state read back to take"):
        rec.take_state()
    assert rec.written() == "writing"
    assert (rec.checkpoint, pieces.writing()) == (Checkpoint.WRITTEN, [])
    with pytest.raises(IllegalTransition,
                       match="version 2: cannot note its checkpoint written in state "
                             "'written' \\(expected 'writing'\\)"):
        rec.written()
    assert rec.release() == "weights"
    assert not pieces.is_published(2) and pieces.in_weights(Weights.RELEASED) == [rec]
    with pytest.raises(IllegalTransition, match="cannot release in state 'released'"):
        rec.release()
    with pytest.raises(IllegalTransition, match="version 2: cannot make it"):
        pieces.made(2, "again")


def test_a_version_released_while_its_checkpoint_is_written_keeps_that_future():
    pieces = Pieces()
    rec = pieces.made(0, "weights", checkpoint="writing")
    assert rec.release() == "weights"
    assert pieces.writing() == [rec] and rec.written() == "writing"


def test_a_version_the_run_does_not_checkpoint_is_never_writing():
    pieces = Pieces()
    rec = pieces.made(5, "weights", state="state")
    assert rec.checkpoint is Checkpoint.NOT_WRITTEN and pieces.writing() == []
    with pytest.raises(IllegalTransition, match="in state 'not written'"):
        rec.written()


def test_a_stored_version_is_read_back_once_and_evaluated_once():
    pieces = Pieces()
    rec = pieces.stored(4)
    assert (rec.weights, rec.checkpoint) == (Weights.STORED, Checkpoint.WRITTEN)
    assert not pieces.is_published(4) and pieces.in_weights(Weights.STORED) == [rec]
    with pytest.raises(IllegalTransition, match="cannot evaluate it"):
        rec.evaluate()
    with pytest.raises(IllegalTransition, match="cannot release in state 'stored'"):
        rec.release()
    rec.publish("weights", "state")
    assert pieces.is_published(4) and pieces.in_weights(Weights.STORED) == []
    with pytest.raises(IllegalTransition, match="version 4: cannot publish it in state 'published'"):
        rec.publish("again")
    with pytest.raises(IllegalTransition, match="version 4: cannot restore it from the store"):
        pieces.stored(4)
    rec.evaluate()
    with pytest.raises(IllegalTransition, match="evaluated True"):
        rec.evaluate()


def test_records_are_made_as_first_needed_and_described():
    pieces = Pieces()
    assert pieces.stage(7) is Stage.PLANNED and 7 not in pieces.iterations
    pieces.iteration(1).rollout_in({}, {})
    pieces.made(1, "w", checkpoint="c")
    assert pieces.describe() == "iterations {1: rollout}, versions {1: published/writing}"
    with pytest.raises(KeyError):
        pieces.version(2)


def test_the_layout_answers_through_its_retention_rule():
    layout = GraphLayout(num_steps=4, trained_steps=2, version_lag=1, kl=True,
                         checkpoint_every=4)
    rule = Retention(version_lag=1, kl=True, checkpoint_every=4)
    assert layout.retention == rule
    assert [layout.writes_checkpoint(v, 10) for v in range(11)] == [
        rule.writes_checkpoint(v, 10) for v in range(11)]
    assert layout.keeps_checkpoint(3, 6, 10) == rule.keeps_checkpoint(3, 6, 10)
