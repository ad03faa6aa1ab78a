"""The databases and question templates of the ``sql`` env.

Three small domains (a company, a shop, a school), each a schema, a seeded filler that makes
its rows and a list of question templates: selects with joins, groups, orders and limits, and
writes (updates, inserts, deletes, some in two statements). A template's ``{placeholders}`` are
filled with values drawn from the database (``params``: a SELECT giving the candidates, or a
tuple of constants); ``dept2`` draws from ``dept``'s source a value different from ``dept``'s.
"""
from __future__ import annotations

import random
import sqlite3
import string
from functools import lru_cache
from typing import Callable, NamedTuple

FIRST = "Ada Ben Cleo Dan Eva Finn Gia Hugo Ines Jon Kai Lena Milo Nora Omar Pia Rosa Sami Tara Vik".split()
LAST = "Moss Reed Lund Hale Voss Park Cruz Dale Frey Gray Holt Ives Kemp Lowe Marsh Nash".split()
NEW_NAMES = tuple(f"{f} {last}" for f in FIRST[:8] for last in ("Novak", "Quill"))
CITIES = "Lisbon Oslo Austin Osaka Lyon Perth Quito".split()


class Template(NamedTuple):
    text: str
    sql: tuple[str, ...]  # one SELECT, or the write statements in order
    ordered: bool = False  # the question asks for an order: answers are compared as lists


class Domain(NamedTuple):
    schema: str
    fill: Callable[[random.Random], dict[str, list[tuple]]]
    params: dict[str, str | tuple]
    templates: tuple[Template, ...]


def _people(rng: random.Random, low: int, high: int) -> list[str]:
    return rng.sample([f"{f} {last}" for f in FIRST for last in LAST], rng.randint(low, high))


def _fill_company(rng: random.Random) -> dict[str, list[tuple]]:
    depts = rng.sample("Sales Research Support Finance Marketing Legal Operations".split(), rng.randint(4, 6))
    cities = rng.sample(CITIES, 3)
    projects = rng.sample("Apollo Borealis Cobalt Delta Ember Falcon Granite Helix Ion Juniper".split(),
                          rng.randint(5, 7))
    people = _people(rng, 16, 24)
    assignments = [(e, p, rng.randrange(5, 41, 5)) for e in range(1, len(people) + 1)
                   for p in rng.sample(range(1, len(projects) + 1), rng.randint(0, 2))]
    return {
        "departments": [(i, d, rng.choice(cities)) for i, d in enumerate(depts, 1)],
        "employees": [(i, n, rng.randint(1, len(depts)), rng.randrange(3000, 9001, 100),
                       rng.randint(2012, 2024)) for i, n in enumerate(people, 1)],
        "projects": [(i, p, rng.randint(1, len(depts)), rng.randrange(20000, 200001, 5000))
                     for i, p in enumerate(projects, 1)],
        "assignments": assignments,
    }


def _fill_shop(rng: random.Random) -> dict[str, list[tuple]]:
    kinds = {"kitchen": "Kettle Pan Knife Bowl", "garden": "Rake Hose Shovel Planter",
             "toys": "Kite Puzzle Robot Yoyo", "books": "Atlas Novel Cookbook Diary"}
    catalogue = [(f"{adj} {noun}", cat) for cat, nouns in kinds.items() for noun in nouns.split()
                 for adj in ("Red", "Mini", "Classic")]
    products = rng.sample(catalogue, rng.randint(10, 14))
    customers, cities = _people(rng, 12, 18), rng.sample(CITIES, 4)
    orders = [(i, rng.randint(1, len(customers)), rng.randint(1, len(products)), rng.randint(1, 5),
               f"2024-{rng.randint(1, 6):02d}-{rng.randint(1, 28):02d}") for i in range(1, rng.randint(30, 45))]
    return {
        "customers": [(i, n, rng.choice(cities)) for i, n in enumerate(customers, 1)],
        "products": [(i, n, c, rng.randrange(299, 9999) / 100) for i, (n, c) in enumerate(products, 1)],
        "orders": orders,
    }


def _fill_school(rng: random.Random) -> dict[str, list[tuple]]:
    titles = rng.sample("Algebra Biology Chemistry Drawing Economics French Geometry History Music Physics".split(),
                        rng.randint(6, 8))
    teachers = rng.sample("Abe Bell Chen Diaz Egan Ford".split(), 4)
    students = _people(rng, 15, 20)
    return {
        "students": [(i, n, rng.randint(1, 4)) for i, n in enumerate(students, 1)],
        "courses": [(i, t, rng.choice((2, 3, 4, 5)), rng.choice(teachers)) for i, t in enumerate(titles, 1)],
        "enrollments": [(s, c, rng.randint(45, 100)) for s in range(1, len(students) + 1)
                        for c in rng.sample(range(1, len(titles) + 1), rng.randint(2, 4))],
    }


_DEPT_ID = "(SELECT id FROM departments WHERE name = '{%s}')"
_EMP_ID = "(SELECT id FROM employees WHERE name = '{worker}')"
_COURSE_ID = "(SELECT id FROM courses WHERE title = '{taken}')"

COMPANY = Domain(
    schema="""
CREATE TABLE departments (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT NOT NULL);
CREATE TABLE employees (id INTEGER PRIMARY KEY, name TEXT NOT NULL, dept_id INTEGER, salary INTEGER, hired INTEGER);
CREATE TABLE projects (id INTEGER PRIMARY KEY, name TEXT NOT NULL, dept_id INTEGER, budget INTEGER);
CREATE TABLE assignments (employee_id INTEGER, project_id INTEGER, hours INTEGER, PRIMARY KEY (employee_id, project_id));
""",
    fill=_fill_company,
    params={"dept": "SELECT name FROM departments", "city": "SELECT city FROM departments",
            "emp": "SELECT name FROM employees",
            "worker": "SELECT e.name FROM employees e JOIN assignments a ON a.employee_id = e.id",
            "new_id": "SELECT MAX(id) + 1 FROM employees", "new_name": NEW_NAMES,
            "year": tuple(range(2014, 2023)), "salary": (4000, 5000, 6000, 7000), "pct": (5, 10, 15, 20),
            "k": (3, 4, 5), "n": (2, 3, 4), "amount": (1000, 5000, 10000)},
    templates=(
        Template("Which employees work in the {dept} department? List their names.",
                 ("SELECT e.name FROM employees e JOIN departments d ON d.id = e.dept_id WHERE d.name = '{dept}'",)),
        Template("How many employees does each department based in {city} have? Give the department name and the count.",
                 ("SELECT d.name, COUNT(e.id) FROM departments d LEFT JOIN employees e ON e.dept_id = d.id "
                  "WHERE d.city = '{city}' GROUP BY d.id",)),
        Template("Who are the {k} best-paid employees? List their names from the highest salary down (ties by name).",
                 ("SELECT name FROM employees ORDER BY salary DESC, name LIMIT {k}",), True),
        Template("What is the average salary in the {dept} department, rounded to 2 decimals?",
                 ("SELECT ROUND(AVG(e.salary), 2) FROM employees e JOIN departments d ON d.id = e.dept_id "
                  "WHERE d.name = '{dept}'",)),
        Template("Which projects is {worker} assigned to?",
                 ("SELECT p.name FROM projects p JOIN assignments a ON a.project_id = p.id "
                  "JOIN employees e ON e.id = a.employee_id WHERE e.name = '{worker}'",)),
        Template("Which employees hired after {year} earn more than {salary}?",
                 ("SELECT name FROM employees WHERE hired > {year} AND salary > {salary}",)),
        Template("How many hours in total are assigned to each project of the {dept} department? "
                 "Give the project name and the total.",
                 ("SELECT p.name, SUM(a.hours) FROM projects p JOIN assignments a ON a.project_id = p.id "
                  "JOIN departments d ON d.id = p.dept_id WHERE d.name = '{dept}' GROUP BY p.id",)),
        Template("Which departments have more than {n} employees?",
                 ("SELECT d.name FROM departments d JOIN employees e ON e.dept_id = d.id GROUP BY d.id "
                  "HAVING COUNT(*) > {n}",)),
        Template("Give every employee of the {dept} department a {pct}% raise, rounding the new salaries "
                 "to whole numbers.",
                 ("UPDATE employees SET salary = ROUND(salary * (100 + {pct}) / 100.0) "
                  "WHERE dept_id = " + _DEPT_ID % "dept",)),
        Template("Hire {new_name} into the {dept} department with id {new_id}, a salary of {salary} and "
                 "hiring year 2024.",
                 ("INSERT INTO employees (id, name, dept_id, salary, hired) "
                  "SELECT {new_id}, '{new_name}', id, {salary}, 2024 FROM departments WHERE name = '{dept}'",)),
        Template("{worker} leaves the company: delete their project assignments, then their employee record.",
                 ("DELETE FROM assignments WHERE employee_id = " + _EMP_ID,
                  "DELETE FROM employees WHERE name = '{worker}'")),
        Template("Move every project of the {dept} department to the {dept2} department and add {amount} "
                 "to the budget of each moved project.",
                 ("UPDATE projects SET dept_id = " + _DEPT_ID % "dept2" + ", budget = budget + {amount} "
                  "WHERE dept_id = " + _DEPT_ID % "dept",)),
    ),
)

SHOP = Domain(
    schema="""
CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT NOT NULL);
CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT NOT NULL, category TEXT NOT NULL, price REAL);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER, product_id INTEGER, quantity INTEGER, day TEXT);
""",
    fill=_fill_shop,
    params={"city": "SELECT city FROM customers", "customer": "SELECT name FROM customers",
            "buyer": "SELECT c.name FROM customers c JOIN orders o ON o.customer_id = c.id",
            "category": "SELECT category FROM products", "product": "SELECT name FROM products",
            "new_oid": "SELECT MAX(id) + 1 FROM orders", "month": tuple(f"2024-0{m}" for m in range(2, 7)),
            "price": (10, 20, 30, 50), "amount": (100, 200, 300), "k": (3, 4, 5), "pct": (5, 10, 20),
            "q": (1, 2, 3, 4, 5)},
    templates=(
        Template("Which customers from {city} have placed at least one order? List their names.",
                 ("SELECT DISTINCT c.name FROM customers c JOIN orders o ON o.customer_id = c.id "
                  "WHERE c.city = '{city}'",)),
        Template("What is the total revenue (price times quantity) of each product category, rounded to "
                 "2 decimals? Give the category and the revenue.",
                 ("SELECT p.category, ROUND(SUM(p.price * o.quantity), 2) FROM products p "
                  "JOIN orders o ON o.product_id = p.id GROUP BY p.category",)),
        Template("Which {k} products sold the most units? List their names, most units first (ties by name).",
                 ("SELECT p.name FROM products p JOIN orders o ON o.product_id = p.id GROUP BY p.id "
                  "ORDER BY SUM(o.quantity) DESC, p.name LIMIT {k}",), True),
        Template("How many orders were placed in the month {month} (year-month)?",
                 ("SELECT COUNT(*) FROM orders WHERE day LIKE '{month}-%'",)),
        Template("Which products in the {category} category cost less than {price}?",
                 ("SELECT name FROM products WHERE category = '{category}' AND price < {price}",)),
        Template("Which customers have spent more than {amount} in total (price times quantity)?",
                 ("SELECT c.name FROM customers c JOIN orders o ON o.customer_id = c.id "
                  "JOIN products p ON p.id = o.product_id GROUP BY c.id HAVING SUM(p.price * o.quantity) > {amount}",)),
        Template("What has {buyer} ordered? Give each product name with the total quantity.",
                 ("SELECT p.name, SUM(o.quantity) FROM orders o JOIN products p ON p.id = o.product_id "
                  "JOIN customers c ON c.id = o.customer_id WHERE c.name = '{buyer}' GROUP BY p.id",)),
        Template("Raise the price of every product in the {category} category by {pct}%, rounded to 2 decimals.",
                 ("UPDATE products SET price = ROUND(price * (100 + {pct}) / 100.0, 2) "
                  "WHERE category = '{category}'",)),
        Template("Record order {new_oid}: {customer} buys {q} units of {product} on 2024-07-01.",
                 ("INSERT INTO orders (id, customer_id, product_id, quantity, day) "
                  "SELECT {new_oid}, c.id, p.id, {q}, '2024-07-01' FROM customers c, products p "
                  "WHERE c.name = '{customer}' AND p.name = '{product}'",)),
        Template("Delete every order placed before {month}-01.",
                 ("DELETE FROM orders WHERE day < '{month}-01'",)),
        Template("{buyer} closed their account: delete their orders, then the customer.",
                 ("DELETE FROM orders WHERE customer_id = (SELECT id FROM customers WHERE name = '{buyer}')",
                  "DELETE FROM customers WHERE name = '{buyer}'")),
    ),
)

SCHOOL = Domain(
    schema="""
CREATE TABLE students (id INTEGER PRIMARY KEY, name TEXT NOT NULL, year INTEGER);
CREATE TABLE courses (id INTEGER PRIMARY KEY, title TEXT NOT NULL, credits INTEGER, teacher TEXT);
CREATE TABLE enrollments (student_id INTEGER, course_id INTEGER, grade INTEGER, PRIMARY KEY (student_id, course_id));
""",
    fill=_fill_school,
    params={"student": "SELECT name FROM students", "course": "SELECT title FROM courses",
            "taken": "SELECT c.title FROM courses c JOIN enrollments e ON e.course_id = c.id",
            "learner": "SELECT s.name FROM students s JOIN enrollments e ON e.student_id = s.id",
            "teacher": "SELECT teacher FROM courses", "n": (2, 3, 4), "k": (3, 4, 5),
            "grade": (60, 70, 80), "bonus": (5, 10), "year": (1, 2, 3, 4)},
    templates=(
        Template("Which students are enrolled in {taken}? List their names.",
                 ("SELECT s.name FROM students s JOIN enrollments e ON e.student_id = s.id "
                  "JOIN courses c ON c.id = e.course_id WHERE c.title = '{taken}'",)),
        Template("What is the average grade in each course taught by {teacher}, rounded to 2 decimals? "
                 "Give the course title and the average.",
                 ("SELECT c.title, ROUND(AVG(e.grade), 2) FROM courses c JOIN enrollments e ON e.course_id = c.id "
                  "WHERE c.teacher = '{teacher}' GROUP BY c.id",)),
        Template("Which {k} students have the highest average grade? List their names, best first (ties by name).",
                 ("SELECT s.name FROM students s JOIN enrollments e ON e.student_id = s.id GROUP BY s.id "
                  "ORDER BY AVG(e.grade) DESC, s.name LIMIT {k}",), True),
        Template("How many credits does {learner} take in total?",
                 ("SELECT SUM(c.credits) FROM courses c JOIN enrollments e ON e.course_id = c.id "
                  "JOIN students s ON s.id = e.student_id WHERE s.name = '{learner}'",)),
        Template("Which courses have more than {n} students enrolled?",
                 ("SELECT c.title FROM courses c JOIN enrollments e ON e.course_id = c.id GROUP BY c.id "
                  "HAVING COUNT(*) > {n}",)),
        Template("Which year-{year} students scored below {grade} in some course?",
                 ("SELECT DISTINCT s.name FROM students s JOIN enrollments e ON e.student_id = s.id "
                  "WHERE s.year = {year} AND e.grade < {grade}",)),
        Template("Enrol {student} in {course} (no grade yet, so the grade is NULL).",
                 ("INSERT INTO enrollments (student_id, course_id, grade) SELECT s.id, c.id, NULL "
                  "FROM students s, courses c WHERE s.name = '{student}' AND c.title = '{course}'",)),
        Template("Add {bonus} points to every grade in {taken}, capping grades at 100.",
                 ("UPDATE enrollments SET grade = MIN(100, grade + {bonus}) WHERE course_id = " + _COURSE_ID,)),
        Template("{teacher} is retiring: give all of their courses to {teacher2}.",
                 ("UPDATE courses SET teacher = '{teacher2}' WHERE teacher = '{teacher}'",)),
        Template("Delete every enrollment in {taken} with a grade below {grade}.",
                 ("DELETE FROM enrollments WHERE grade < {grade} AND course_id = " + _COURSE_ID,)),
    ),
)

DOMAINS = {"company": COMPANY, "shop": SHOP, "school": SCHOOL}


@lru_cache(maxsize=256)
def build_db(domain: str, seed: int) -> bytes:
    """The serialized database of ``domain`` filled from ``seed`` (made once per process)."""
    dom = DOMAINS[domain]
    conn = sqlite3.connect(":memory:")
    conn.executescript(dom.schema)
    for table, rows in dom.fill(random.Random(f"sql-db:{domain}:{seed}")).items():
        conn.executemany(f"INSERT INTO {table} VALUES ({', '.join('?' * len(rows[0]))})", rows)
    conn.commit()
    data = conn.serialize()
    conn.close()
    return data


def fill_template(conn: sqlite3.Connection, domain: Domain, template: Template,
                  rng: random.Random) -> tuple[str, tuple[str, ...]]:
    """The question text and its SQL with every placeholder drawn from the database."""
    names = {f for part in (template.text, *template.sql)
             for _, f, _, _ in string.Formatter().parse(part) if f}
    values: dict[str, object] = {}
    for name in sorted(names):
        base = name.rstrip("0123456789")
        source = domain.params[base]
        pool = source if isinstance(source, tuple) else sorted(
            {r[0] for r in conn.execute(source)}, key=str)
        pool = [v for v in pool if v not in values.values() or base == name] or list(pool)
        values[name] = rng.choice(pool)
    return template.text.format(**values), tuple(s.format(**values) for s in template.sql)
