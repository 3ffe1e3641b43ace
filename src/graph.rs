//! The stage DAG: a validated [`Pipeline`]'s stages as a petgraph graph, in dependency order.
//!
//! Cycles are reported as pipeline problems that name the whole cycle (`a -> b -> c -> a`).

use petgraph::algo::{tarjan_scc, toposort};
use petgraph::graph::{DiGraph, NodeIndex};

use crate::pipeline::{Pipeline, Problem, Problems};

/// Stage indices (into `Pipeline::stages`) with edges upstream -> downstream.
pub struct Graph {
    dag: DiGraph<usize, ()>,
    /// Stage indices in an order where every stage comes after its inputs.
    pub order: Vec<usize>,
    /// Per stage, the index of each input's stage, in the order the pipeline lists them.
    pub inputs: Vec<Vec<usize>>,
}

impl Graph {
    /// Build the DAG; a cycle is an error naming it.
    pub fn build(pipeline: &Pipeline) -> Result<Self, Box<Problems>> {
        let index: std::collections::HashMap<&str, usize> = pipeline
            .stages
            .iter()
            .enumerate()
            .map(|(i, s)| (s.id.as_str(), i))
            .collect();
        let mut graph = DiGraph::with_capacity(pipeline.stages.len(), pipeline.stages.len());
        for i in 0..pipeline.stages.len() {
            graph.add_node(i);
        }
        // Validation guarantees every input names a stage.
        let inputs: Vec<Vec<usize>> = pipeline
            .stages
            .iter()
            .map(|s| {
                s.inputs
                    .iter()
                    .filter_map(|inp| index.get(inp.stage.as_str()).copied())
                    .collect()
            })
            .collect();
        for (i, ups) in inputs.iter().enumerate() {
            for &up in ups {
                graph.add_edge(NodeIndex::new(up), NodeIndex::new(i), ());
            }
        }
        match toposort(&graph, None) {
            Ok(order) => Ok(Self {
                order: order.into_iter().map(|n| graph[n]).collect(),
                inputs,
                dag: graph,
            }),
            Err(_) => Err(Box::new(
                pipeline.problems(cycle_problems(pipeline, &graph)),
            )),
        }
    }

    /// Indices of the stages that take `stage`'s output.
    pub fn downstream(&self, stage: usize) -> impl Iterator<Item = usize> + '_ {
        self.dag
            .neighbors_directed(NodeIndex::new(stage), petgraph::Direction::Outgoing)
            .map(|n| self.dag[n])
    }

    /// Indices of `stage`'s inputs.
    pub fn upstream(&self, stage: usize) -> impl Iterator<Item = usize> + '_ {
        self.dag
            .neighbors_directed(NodeIndex::new(stage), petgraph::Direction::Incoming)
            .map(|n| self.dag[n])
    }
}

fn cycle_problems(pipeline: &Pipeline, graph: &DiGraph<usize, ()>) -> Vec<Problem> {
    let mut out = Vec::new();
    for scc in tarjan_scc(graph) {
        if scc.len() < 2 {
            continue;
        }
        // Walk the cycle from its first stage in file order, staying inside the component.
        let members: std::collections::HashSet<NodeIndex> = scc.iter().copied().collect();
        let start = *scc.iter().min_by_key(|n| graph[**n]).expect("non-empty");
        let mut path = vec![start];
        let mut cur = start;
        loop {
            // Follow inputs (incoming edges), so the cycle reads "a takes b takes c takes a".
            let next = graph
                .neighbors_directed(cur, petgraph::Direction::Incoming)
                .filter(|n| members.contains(n))
                .min_by_key(|n| (!path.contains(n) && *n != start, graph[*n]))
                .expect("a strongly connected component has an edge out of every node");
            if next == start || path.contains(&next) {
                break;
            }
            path.push(next);
            cur = next;
        }
        let names: Vec<&str> = path
            .iter()
            .map(|n| pipeline.stages[graph[*n]].id.as_str())
            .collect();
        let shown = format!("{} -> {}", names.join(" -> "), names[0]);
        let first = &pipeline.stages[graph[start]].id;
        out.push(
            Problem::new(
                "dflash::graph::cycle",
                format!("stages form a cycle through their inputs: {shown}"),
                pipeline.stage_span(first),
                "this stage depends on itself through the cycle",
            )
            .help("a pipeline is a DAG: remove one of the inputs in the cycle"),
        );
    }
    out
}
