"""The web environment (SPEC section 7): real Chromium through Playwright, MiniWoB++ and WebGym-style
tasks, observations, the action grammar, and the prompt the agent reads.

browser.py      one Chromium process, many contexts; a fresh context per episode, crash relaunch, deadlines
fence.py        the network fence: a filtering proxy per context that checks every resolved address
miniwob.py      MiniWoB++ tasks from the `miniwob` package, served on 127.0.0.1
webgym.py       JSONL task files (start URL, budget, allowed origins, evaluator) + demo_site/
observe.py      screenshot, interactive element list (in-page runtime), set-of-marks overlay
actions.py      model text -> action dict -> real mouse/keyboard events
prompt.py       the chat messages of one step (training and evaluation share it)
tasks.py        named task subsets and the checkpointable TaskSampler
env_factory.py  make_env(env_cfg) for env.type miniwob / webgym / synthetic
oracles.py      scripted MiniWoB solvers (reward-path proof, demonstrations)
gym_env.py      Gymnasium registration: gymnasium.make("asyncwebrl/miniwob-click-button-v0")
"""
