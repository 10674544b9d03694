"""The update moves the policy the right way and by a sane amount: in a GRPO group where one action
succeeds and another fails, a step raises the successful action's logprob and lowers the failing one's."""

from asyncwebrl.records import RolloutGroup, StepSample, TrainSample, Trajectory
from asyncwebrl.training.actor import FSDPActor
from asyncwebrl.training.config import ActorConfig


def test_a_step_favours_the_rewarded_action_of_a_group():
    actor = FSDPActor(ActorConfig(lr=3e-6, temperature=0.7))
    ad = actor.adapter
    prompt = ad.encode(ad.chat_text([{"role": "user", "content": "Click the OK button (element 1)."}])).input_ids
    good = ad.tokenizer("click [1]<|im_end|>", add_special_tokens=False)["input_ids"]
    bad = ad.tokenizer("type [2]<|im_end|>", add_special_tokens=False)["input_ids"]

    def logp(out):
        s = TrainSample(prompt_ids=prompt, output_ids=out, behave_logprobs=[0.0] * len(out),
                        versions=[0] * len(out), advantage=0.0)
        return actor.compute_logprobs([s])[0]

    before_good, before_bad = sum(logp(good)), sum(logp(bad))
    trajs = []
    for i, (out, reward) in enumerate([(good, 1.0), (good, 1.0), (bad, 0.0), (bad, 0.0)]):
        step = StepSample(prompt_ids=prompt, output_ids=out, behave_logprobs=logp(out), versions=[0] * len(out))
        trajs.append(Trajectory(traj_id=f"t{i}", task_id="toy#0", steps=[step], reward=reward, success=reward > 0))
    metrics = actor.train_step([RolloutGroup(group_id="g", task_id="toy#0", trajectories=trajs)])
    after_good, after_bad = sum(logp(good)), sum(logp(bad))
    assert after_good > before_good + 0.5
    assert after_bad < before_bad - 0.5
    # a sane step: the default learning rate does not jump by tens of nats (3e-5 did, and collapsed)
    assert after_good - before_good < 8
    assert metrics["clip_rate"] == 0.0  # first step from pi_prox: ratios are exactly 1
    actor.close()
