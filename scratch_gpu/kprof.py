import sys, random
sys.path.insert(0, ".")
import torch
from torch.profiler import profile, ProfilerActivity
from services.common.config import load_config
from services.common.tokenizer import load_tokenizer
from services.rl_rollout.engine import Engine, Request
from services.rl_rollout.rewards import get_task
from services.rl_rollout.sampling import SamplingParams
from services.trainer.model.transformer import MoETransformer
cfg = load_config("configs/qwen3_30b_a3b.yaml", ["model.num_layers=2", "rl.max_batch=256", "rl.max_seq_len=96"])
m = MoETransformer(cfg.model); m.init_weights(0); m = m.to("cuda", torch.bfloat16).eval()
tok = load_tokenizer(cfg.data.tokenizer); task = get_task(cfg.rl.task); rng = random.Random(0)
p = SamplingParams(temperature=1.0, max_tokens=64, stop=(), stop_at_eos=False)
reqs = [Request(tok.encode(task.make_prompt(rng, 1)[0]), p, tag=i) for i in range(512)]
e = Engine(m, tok, 256, 96, seed=0)
e.generate(reqs); torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    e.generate(reqs); torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))
