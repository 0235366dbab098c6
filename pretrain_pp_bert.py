"""BERT sequence classification, pipeline parallelism (pp_deg = world unless the config says; torch.distributed.pipelining). See README.md; run with --help for the arguments."""
from galaxy.launch import main
from galaxy.train.trainer import prepare_classifier, train

if __name__ == "__main__":
    main(preset="pp", prepare_fn=prepare_classifier, train_fn=train, script="pretrain_pp_bert.py",
         default_config="train_config/bert/pp/full.json", model_type="bert")
